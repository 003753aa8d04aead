"""The maru-shm command line: create, inspect, check, watch, destroy, bench."""
