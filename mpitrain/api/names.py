"""Names of the calls an adapter makes on a user's behalf.

An adapter's hidden collectives (an autograd op's backward pass, the row
counts it gathers first) are named after the user's call. An unnamed call's
automatic name (array_ops.automatic_name) remembers where in the program it
was made, so that ranks can check they pair calls from the same place;
``derived`` keeps that place in the names made from it. An adapter that
numbers calls itself (the torch.distributed backend) names them with
``AutoName(name, place)`` so that ranks check its places too. The numbering
lives in the engine (engine/naming.py); this module is the adapters' door to it.
"""

from mpitrain.engine.naming import AutoName, derived

__all__ = ["AutoName", "derived"]
