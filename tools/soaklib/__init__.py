"""The parts of the reliability soak (tools/soak.py runs the rounds):

config    SoakConfig, the fault names, client deadlines
recorder  every call's status and answer, the faults, the violations, the outage windows
workload  shared prefixes, conversations, sampling, the greedy check prompts
calls     one recorded Generate stream (its shape checked) or unary call
traffic   the client threads and the Pauser;  admin  the admin thread's actions
daemon    `hicache serve` as a subprocess;    l3     its L3 dir and the faults done to it
faults    the fault schedule and the injector
checks    end-of-round checks (idle, KV accounting, greedy outputs), RSS flatness
reference every answer against its prompt computed alone on a fresh daemon
plot      the per-round figure
"""
