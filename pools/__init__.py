"""tokenfab: pools."""
