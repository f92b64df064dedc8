"""Wire: trio over ZeroMQ, the msgpack codec, message classes, CURVE keys and ZAP."""
