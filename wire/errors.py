"""The one error type every decoder raises."""

from __future__ import annotations


class ProtocolError(Exception):
    """A frame or message that does not decode to a valid protocol message.

    Every decoder in `triode.wire` is total: any input either decodes to a valid message or
    raises this. Receivers log and count it; a bad frame never kills an actor.
    """
