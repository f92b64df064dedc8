"""KV-cache-aware routing, the pure core: the engines' own KV-cache events decoded
(`events`), the router's block keys chained from token ids (`blocks`), a bounded
per-replica index of what each engine holds (`index`) and the choice of a replica
(`score`). Data in, data out: no sockets, trio, zmq or clocks (time is passed in).

This face imports nothing, so importing one module of the room loads only that one.
"""
