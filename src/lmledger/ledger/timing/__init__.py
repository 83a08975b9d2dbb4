"""Where a step's seconds go: the roofline bound (roofline), a profiled step grouped the same way (profile),
tensor-core shape advice (shapes), the throughput window (throughput), and the predicted step time
(steptime/).
"""
