"""Native kernels shared by the attention package and the CPU backend.

``cpu_kernels.py`` builds and loads ``cpu_kernels.c`` (paged attention, RMSNorm, rope, int8
linears, the fused decode step). It sits below everything that calls it (workers/attention,
workers/backends) and imports no project module but ``mindie.contract``.
"""
