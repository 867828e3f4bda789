"""Build a tiny random-weight HuggingFace model directory that vLLM can serve.

Everything is generated offline from a seed, so the same seed gives byte-identical files.
"""

from __future__ import annotations

import hashlib
import os
import random
import shutil
import tempfile
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    PretrainedConfig,
    PreTrainedTokenizerFast,
)

VOCAB_SIZE = 2048
MAX_POSITIONS = 4096
BOS, EOS, UNK, PAD = "<s>", "</s>", "<unk>", "<pad>"
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [BOS, EOS, UNK, PAD, IM_START, IM_END]
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
WEIGHTS_FILE = "model.safetensors"

_WORDS = """
the a an of to and in is it that was for on are with as his they be at one have this
from or had by word but what some we can out other were all there when up use your how
said each she which do their time if will way about many then them write would like so
these her long make thing see him two has look more day could go come did number sound
no most people my over know water than call first who may down side been now find any
new work part take get place made live where after back little only round man year came
show every good me give our under name very through just form sentence great think say
help low line turn cause much mean before move right boy old too same tell does set three
want air well also play small end put home read hand port large spell add even land here
must big high such follow act why ask men change went light kind off need house picture
try again animal point mother world near build self earth father head stand own page
should country found answer school grow study still learn plant cover food sun four
between state keep eye never last let thought city tree cross farm hard start might story
saw far sea draw left late run while press close night real life few north open seem
together next white children begin got walk example paper group always music those both
mark often letter until mile river car feet care second book carry took science eat room
friend began idea fish mountain stop once base hear horse cut sure watch color face wood
café naïve über straße garçon
""".split()
_ENDINGS = [".", ".", ".", "!", "?", ";"]
_SENTENCES = 4000


def _sentence(rng: random.Random) -> str:
    words = [rng.choice(_WORDS) for _ in range(rng.randint(4, 14))]
    # Numbers and commas give BPE enough distinct pairs to fill the whole vocab.
    if rng.random() < 0.4:
        words.insert(rng.randrange(len(words)), str(rng.randint(0, 99999)))
    if rng.random() < 0.2:
        words[rng.randrange(len(words))] += ","
    words[0] = words[0].capitalize()
    return " ".join(words) + rng.choice(_ENDINGS)


def _corpus(seed: int) -> list[str]:
    rng = random.Random(seed)
    return [_sentence(rng) for _ in range(_SENTENCES)]


def _train_tokenizer(seed: int) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    # Byte-level with no prefix space, so decode(encode(text)) == text for any text.
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_corpus(seed), trainer)
    return tokenizer


def _hf_tokenizer(seed: int) -> PreTrainedTokenizerFast:
    return PreTrainedTokenizerFast(
        tokenizer_object=_train_tokenizer(seed),
        bos_token=BOS,
        eos_token=EOS,
        unk_token=UNK,
        pad_token=PAD,
        extra_special_tokens=[IM_START, IM_END],
        chat_template=CHAT_TEMPLATE,
        # The default cleanup would rewrite " ." to "." and break round-trips.
        clean_up_tokenization_spaces=False,
        model_max_length=MAX_POSITIONS,
    )


def _model_config(tokenizer: PreTrainedTokenizerFast, moe: bool) -> PretrainedConfig:
    common = dict(
        vocab_size=len(tokenizer),
        hidden_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=MAX_POSITIONS,
        initializer_range=0.02,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        dtype="bfloat16",
    )
    if moe:
        return MixtralConfig(
            intermediate_size=256, num_local_experts=4, num_experts_per_tok=2, **common
        )
    return LlamaConfig(intermediate_size=512, **common)


def _save_model(config: PretrainedConfig, out: Path, seed: int) -> None:
    model_class = MixtralForCausalLM if config.model_type == "mixtral" else LlamaForCausalLM
    # fork_rng keeps the caller's global torch RNG state untouched.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_class(config)
    # transformers wraps `to` with @wraps(Module.to), whose type wants the module as first argument
    model.to(torch.bfloat16).save_pretrained(  # type: ignore[arg-type]
        out, safe_serialization=True)


def _save_generation_config(tokenizer: PreTrainedTokenizerFast, out: Path) -> None:
    # vLLM stops on every id listed here, so chat turns end at <|im_end|> too.
    GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=[tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids(IM_END)],
        pad_token_id=tokenizer.pad_token_id,
    ).save_pretrained(out)


def build_tiny_model(out: Path, *, moe: bool = False, seed: int = 0) -> Path:
    """Write a tiny dense (Llama) or MoE (Mixtral) model with its tokenizer into `out`."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = _hf_tokenizer(seed)
    tokenizer.save_pretrained(out)
    _save_model(_model_config(tokenizer, moe), out, seed)
    _save_generation_config(tokenizer, out)
    # transformers writes the weights owner-only; a server running as another user
    # (e.g. in a container) must still read them.
    for file in out.iterdir():
        file.chmod(0o644)
    return out


def model_digest(path: Path) -> str:
    """Return the sha256 of every file's relative name and bytes, in sorted name order."""
    root = Path(path)
    digest = hashlib.sha256()
    for file in sorted(p for p in root.rglob("*") if p.is_file()):
        data = file.read_bytes()
        # Length-prefixing keeps distinct (name, bytes) sequences from colliding.
        name = file.relative_to(root).as_posix().encode()
        for part in (name, data):
            digest.update(len(part).to_bytes(8, "big"))
            digest.update(part)
    return digest.hexdigest()


def _is_complete(out: Path) -> bool:
    return (out / "config.json").is_file() and (out / WEIGHTS_FILE).is_file()


def _publish(tmp: Path, out: Path) -> None:
    try:
        # rename() only succeeds if `out` is absent or empty, so nothing is clobbered.
        os.rename(tmp, out)
    except OSError as err:
        if _is_complete(out):  # a concurrent caller won the race
            return
        raise FileExistsError(f"{out} exists but is not a complete tiny model") from err


def ensure_tiny_model(out: Path, *, moe: bool = False) -> Path:
    """Return `out` untouched if it holds a model, else build one there atomically."""
    out = Path(out)
    if _is_complete(out):
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        build_tiny_model(tmp, moe=moe)
        tmp.chmod(0o755)  # mkdtemp makes it owner-only
        _publish(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out
