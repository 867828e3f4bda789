"""tokenfab: kvtransfer."""
