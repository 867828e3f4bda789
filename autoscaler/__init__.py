"""tokenfab: autoscaler."""
