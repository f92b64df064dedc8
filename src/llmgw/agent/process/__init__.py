"""Engine processes at the OS level: spawning a launch plan in a new session, finding and
signalling processes, and who holds a port."""
