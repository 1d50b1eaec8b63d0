"""The shared-memory transport every collective runs on: the segment, arrival counters and waits,
headers, and the slot and phase protocol."""
