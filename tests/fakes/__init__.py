"""Fakes for true hardware boundaries (NVML), built to mirror the real APIs."""
