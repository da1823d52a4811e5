"""One op per file: a PyTorch reference of each op, and (with the native engine) its Triton kernel."""
