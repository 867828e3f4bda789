"""tokenfab: orchestrator."""
