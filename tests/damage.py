"""Damaging files on purpose, as a failing disk or a careless copy would."""

import os


def flip_byte_in_the_middle(path):
    with open(path, "r+b") as stream:
        stream.seek(os.path.getsize(path) // 2)
        byte = stream.read(1)
        stream.seek(-1, os.SEEK_CUR)
        stream.write(bytes([byte[0] ^ 0xFF]))
