"""The toy LM's closed forms (CS336 lecture 2), each beside its measured twin: the state per rank (memory),
saved activations (activations), the step's peak (peak), its FLOPs on paper (flops), and napkin math before a
run (napkin).
"""
