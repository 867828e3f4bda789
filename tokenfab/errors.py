"""tokenfab's exceptions, drawn in one place.

    TokenfabError
    ├── TopologyError        a topology file or document is invalid (carries one line per problem)
    ├── ClusterError         Ray or Serve cannot be reached, or a deployment failed
    └── EngineError          an engine replica failed (distinct from a bad request)
        └── EngineDeadError  the engine process is gone; the replica must be replaced

Foreign errors (pydantic, yaml, httpx, vLLM) are translated to these at the module that meets them.
"""

from __future__ import annotations


class TokenfabError(Exception):
    """Base of every error tokenfab raises on purpose."""


class TopologyError(TokenfabError):
    def __init__(self, problems: list[str]) -> None:
        super().__init__("\n".join(problems))
        self.problems = problems


class ClusterError(TokenfabError):
    """Ray, the Serve controller or the dashboard failed or is unreachable."""


class EngineError(TokenfabError):
    """An engine replica failed while serving a request."""


class EngineDeadError(EngineError):
    """The engine process died; the replica is unhealthy until Serve replaces it."""
