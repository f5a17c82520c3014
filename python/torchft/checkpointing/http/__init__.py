"""The HTTP checkpoint transport, by role.

:class:`torchft.checkpointing.HTTPTransport` (in :mod:`torchft.checkpointing.http_transport`)
puts these together:

- :mod:`.wire`: the URL layout both ends agree on, and what they share (the logger, the
  cancellation error).
- :mod:`.offer`: one state offered to receivers, and the guard every stream enters.
- :mod:`.serve`: the sender's HTTP server, which serves one offer at a time.
- :mod:`.fetch`: the receiver, one :class:`~.fetch.Receive` per state fetched.
- :mod:`.request`: one streamed GET of a receive.
- :mod:`.native`: the adaptor to the native data path (``torchft._torchft``), both ends.
- :mod:`.hosts`: the address receivers reach the server under.
"""
