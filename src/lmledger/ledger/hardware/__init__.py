"""What a device can do: the GPU table (gpus), the CPU's peak (cpu), square matmul timing (matmul), the peak
lookup MFU divides by (peak_flops), memory bandwidth (bandwidth), links (interconnect), number formats
(dtypes).
"""
