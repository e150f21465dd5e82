"""What several benchmarks share: the one server launcher (``server``), RESULTS.md sections
(``results``), random in-memory adapters (``random_adapters``), an engine over a model file with
PEFT-made adapters (``peft_engine``), the GPU's measured ceilings (``gpu_ceilings``). No entry points."""
