"""The memory model: DeepSpeed's estimators and the NVMe rows (``tables``), our per-rank prediction (``model``),
the bandwidth probe (``probe``) and the planner's candidates and roofline (``planner``). Commands: ``framework.cli``."""
