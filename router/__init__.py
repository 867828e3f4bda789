"""tokenfab: router."""
