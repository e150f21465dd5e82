"""loraplex inference server: engine, model, LoRA runtime and the gRPC edge."""
