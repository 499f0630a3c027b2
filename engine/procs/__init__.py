"""The split daemon (seed 002): the API server process (gRPC, HTTP, tokenizer) talks to a
scheduler process (model, KV pools, radix / hierarchical cache) and a detokenizer process over
ZMQ IPC sockets. See ipc.py for the message flow and split_engine.py for the API side."""
