"""Instruments that count on any tensors, real or fake: the live-tensor tracker (memtrack), every op of a step
with its FLOPs and bytes (ops), and the FLOP counter for any step (flopcounter).
"""
