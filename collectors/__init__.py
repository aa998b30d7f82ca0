"""cancelwatch collectors: talk to the outside world (engines, NVML, /proc) and write runs."""
