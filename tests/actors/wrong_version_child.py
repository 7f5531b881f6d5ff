"""Speaks the child side of the handshake with a protocol version from the future."""

import os
import sys
import time

import zmq

from triode.wire import PROTOCOL_VERSION, Encoder, Hello

up_address = sys.argv[1]
ctx = zmq.Context()
up = ctx.socket(zmq.PUSH)
up.connect(up_address)
up.send_multipart(Encoder().encode(Hello(PROTOCOL_VERSION + 1, os.getpid(), "future")))
up.close(linger=2000)
time.sleep(30)  # the parent must end the handshake, not our exit
ctx.term()
