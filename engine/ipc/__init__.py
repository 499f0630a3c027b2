"""Between the split daemon's processes (seed 002): what they send each other (messages.py) and
how it travels (transport.py: ZMQ sockets, the sender thread, a spawned child's set-up).

Every socket carries pickled lists of messages (one list per send: a sender batches what is
queued), PUSH/PULL over IPC sockets in one private directory:

    API server  --SubmitReq / AbortReq / CallReq / Shutdown-->  scheduler     (sched_in)
    scheduler   --Reply---------------------------------------->  API server    (api_reply)
    scheduler   --TokenOut / DetokStop------------------------->  detokenizer   (detok_in)
    detokenizer --TokenOut (with text)------------------------->  API server    (api_chunks)

Torch-free, like what the messages carry: the API server process imports it.
"""
