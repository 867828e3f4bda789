"""Each patch of a dependency's internals fails loudly on a version it was not written for, and
what it patches still has the shape it was written against in the installed version: a vLLM,
Ray or NIXL upgrade that moves it fails here, not on a request path."""

from __future__ import annotations

import inspect
import sys

import pytest

from pools import vllm_compat
from tokenfab import ray_compat
from tokenfab.compat import require
from tokenfab.errors import CompatError


def params(function) -> list[str]:
    return list(inspect.signature(function).parameters)


def test_an_unknown_version_fails_naming_the_patch() -> None:
    with pytest.raises(CompatError, match=r"patches vLLM \(AsyncLLM.generate, traced\).*0\.33\.0"):
        require("vLLM", "0.33.0", ("0.32.0",), "AsyncLLM.generate, traced")
    require("vLLM", "0.32.0+cpu", ("0.32.0",), "AsyncLLM.generate, traced")  # a local label


def test_the_installed_versions_are_the_ones_written_for() -> None:
    import ray
    import vllm
    from importlib.metadata import version

    from kvtransfer.nixl_tuning import NIXL_VERSIONS

    assert vllm.__version__.split("+")[0] in vllm_compat.VLLM_VERSIONS
    assert ray.__version__.split("+")[0] in ray_compat.RAY_VERSIONS
    assert version("nixl") in NIXL_VERSIONS


def test_asyncllm_generate_takes_what_trace_generate_passes() -> None:
    from vllm.v1.engine.async_llm import AsyncLLM

    assert params(AsyncLLM.generate)[:4] == ["self", "prompt", "sampling_params", "request_id"]
    assert "data_parallel_rank" in params(AsyncLLM.generate)
    assert inspect.isasyncgenfunction(AsyncLLM.generate)


def test_output_processor_keeps_request_states_and_adds_them_in_add_request() -> None:
    from vllm.v1.engine.output_processor import OutputProcessor

    assert params(OutputProcessor.add_request)[:2] == ["self", "request"]
    source = inspect.getsource(OutputProcessor)
    assert "self.request_states" in source and "detokenizer" in source


def test_the_detokenizers_have_what_continue_detokenizer_sets() -> None:
    from vllm.tokenizers.detokenizer_utils import convert_prompt_ids_to_tokens
    from vllm.v1.engine.detokenizer import FastIncrementalDetokenizer, SlowIncrementalDetokenizer

    fast, slow = inspect.getsource(FastIncrementalDetokenizer), \
        inspect.getsource(SlowIncrementalDetokenizer)
    assert "self.stream" in fast and "self.skip_special_tokens" in fast
    for attribute in ("self.tokens", "self.prefix_offset", "self.read_offset", "self.token_ids",
                      "self.tokenizer", "self.skip_special_tokens"):
        assert attribute in slow, attribute
    assert hasattr(FastIncrementalDetokenizer, "decode_next")
    assert hasattr(SlowIncrementalDetokenizer, "decode_next")
    assert params(convert_prompt_ids_to_tokens)[:2] == ["tokenizer", "prompt_ids"]


def test_zmq_event_publisher_derives_each_ranks_endpoint_in_one_static_method() -> None:
    from vllm.distributed.kv_events import ZmqEventPublisher

    assert isinstance(inspect.getattr_static(ZmqEventPublisher, "offset_endpoint_port"),
                      staticmethod)
    assert params(ZmqEventPublisher.offset_endpoint_port) == ["endpoint", "data_parallel_rank"]
    source = inspect.getsource(ZmqEventPublisher)  # vLLM's own, patched in this process or not
    assert "def offset_endpoint_port" in source and "inproc" in source and "tcp" in source
    assert "self.offset_endpoint_port(endpoint, self._dp_rank)" in source  # how it is called


def test_serve_starts_its_grpc_server_on_the_wildcard_through_add_port_to_grpc_server() -> None:
    from ray.serve._private import replica

    assert params(replica.add_port_to_grpc_server)[:2] == ["server", "address"] or \
        getattr(replica.add_port_to_grpc_server, "tokenfab_node_address", False)
    called = inspect.getsource(replica.Replica._on_initialized)
    assert f'add_port_to_grpc_server(self._server, "{ray_compat.WILDCARD}")' in called


def test_ray_workers_hold_their_gcs_client() -> None:
    from ray._private import worker

    assert "worker.gcs_client = node.get_gcs_client()" in inspect.getsource(worker.connect)
    assert isinstance(worker.global_worker, worker.Worker)


def test_nixl_agents_are_made_by_the_bindings_with_a_progress_delay_setting() -> None:
    from nixl._api import nixl_agent

    bindings = sys.modules[nixl_agent.__module__].nixlBind
    assert hasattr(bindings, "nixlAgent") and hasattr(bindings.nixlAgentConfig, "pthrDelay")
    assert "nixlBind.nixlAgent(" in inspect.getsource(nixl_agent)
