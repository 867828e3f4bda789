"""The topology file reference (docs/topology-reference.md), written from the pydantic models'
JSON Schema, so the page says what `tokenfab validate` accepts and nothing else.

Example: `tokenfab topology-reference > docs/topology-reference.md`; a unit test fails when the
committed page differs from what this renders.
"""

from __future__ import annotations

import json
from typing import Any

from orchestrator.config import topology_schema

_HEADER = """# Topology reference

Every field of a topology file, as `tokenfab validate` checks it. Generated from the models in
`orchestrator/config.py`: `tokenfab topology-reference > docs/topology-reference.md` (a test fails
when this page is not current). An unknown field is an error that names it. How the parts fit
together, with examples: [topologies.md](topologies.md).
"""


def render() -> str:
    schema = topology_schema()
    defs = schema.get("$defs", {})
    sections = [_section("Topology", "the file itself", schema)]
    sections += [_section(name, "", defs[name]) for name in _order(schema, defs)]
    return _HEADER + "\n" + "\n".join(sections)


def _order(root: dict[str, Any], defs: dict[str, Any]) -> list[str]:
    """The models in the order a reader meets them: depth first from the file's own fields."""
    seen: list[str] = []

    def visit(node: Any) -> None:
        if isinstance(node, dict):
            ref = node.get("$ref")
            if ref:
                name = ref.rsplit("/", 1)[1]
                if name not in seen:
                    seen.append(name)
                    visit(defs[name].get("properties", {}))
            for value in node.values():
                visit(value)
        elif isinstance(node, list):
            for value in node:
                visit(value)

    visit(root.get("properties", {}))
    return seen + sorted(set(defs) - set(seen))


def _section(name: str, note: str, model: dict[str, Any]) -> str:
    title = f"## {name}" + (f" ({note})" if note else "")
    lines = [title, ""]
    if model.get("description"):
        lines += [_cell(model["description"]), ""]
    required = set(model.get("required", ()))
    lines += ["| field | type | default | description |", "|---|---|---|---|"]
    for field, spec in model.get("properties", {}).items():
        default = "required" if field in required else _default(spec)
        lines.append(f"| `{field}` | {_type(spec)} | {default} | "
                     f"{_cell(spec.get('description', ''))} |")
    return "\n".join(lines) + "\n"


def _type(spec: dict[str, Any]) -> str:
    if "$ref" in spec:
        name = spec["$ref"].rsplit("/", 1)[1]
        return f"[{name}](#{name.lower()})"
    for key in ("anyOf", "oneOf"):
        if key in spec:
            return " or ".join(_type(option) for option in spec[key])
    if "const" in spec:
        return f"`{json.dumps(spec['const'])}`"
    if "enum" in spec:
        return " \\| ".join(f"`{json.dumps(value)}`" for value in spec["enum"])
    kind = spec.get("type", "any")
    if kind == "array":
        return f"list of {_type(spec.get('items', {}))}"
    if kind == "object" and isinstance(spec.get("additionalProperties"), dict):
        return f"map of {_type(spec['additionalProperties'])}"
    bounds = [f"{op} {spec[key]:g}" for key, op in (("minimum", ">="), ("exclusiveMinimum", ">"),
                                                      ("maximum", "<="), ("exclusiveMaximum", "<"))
              if key in spec]
    text = {"null": "null", "integer": "int", "number": "float", "boolean": "bool",
            "string": "string", "object": "map"}.get(kind, kind)
    return text + (f" ({', '.join(bounds)})" if bounds else "")


def _default(spec: dict[str, Any]) -> str:
    if "default" not in spec:  # a factory: an empty collection, or the section's own defaults
        return {"array": "`[]`", "object": "`{}`"}.get(spec.get("type", ""), "its defaults")
    return f"`{json.dumps(spec['default'], separators=(', ', ': '))}`"


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")
