"""How an agreed group runs on this rank: the engine's execution wing.

The executor takes the responses a round agreed on, fuses them (fusion),
streams or packs the arrays, scales them (scaling) and calls the transport;
claims keep two operations in flight from writing the same array.
"""
