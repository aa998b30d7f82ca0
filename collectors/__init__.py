"""cancelwatch collectors: talk to the outside world and write runs, in four rooms.

sources/    one module per thing read (Prometheus text, vLLM /metrics, NVML, process memory)
recording/  the sampler and the recording session (preflight, run, stats)
cancels/    scenarios, the driver, the HTTP request modes, bounded load
engines/    the embedded vLLM, its tiny model, the relay app for in-process cancels

families.py, above the rooms, the one module that reads all four: the table of engine families (how a
target is recognised, its scheduler source, the record options that do not apply to it).

Collectors write through `runstore` and never import `analysis`.
"""
