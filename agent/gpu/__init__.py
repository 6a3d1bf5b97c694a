"""GPU backends: real NVML (pynvml) and a clearly marked simulator."""
