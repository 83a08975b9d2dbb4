"""The dry run: one training step of any model on fake tensors, no compute and no memory.

engine (dry_run, largest_batch, measure_step), the fake copy (fakecopy), manual optimization (manualopt),
what they share (steptypes), mixture-of-experts routing (moe) and both routings' bounds above the engine
(moebounds).
"""
