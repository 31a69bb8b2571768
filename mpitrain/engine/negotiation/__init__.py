"""How the ranks agree on what runs next: the engine's negotiation wing.

The coordinator (rank 0 of each set) pairs the ranks' requests and answers
with responses; the response cache and the control vector let a steady
training loop agree with one bitwise AND per round instead of messages;
the stall inspector names what some ranks wait for; autotune picks the
fusion threshold and cycle time. Nothing here moves tensor data.
"""
