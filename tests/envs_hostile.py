"""Environments that misbehave, for tests/test_envs.py: each is loaded by 'envs_hostile:<Class>' in the
sandbox's child process, as a user's module would be."""

import os
import socket
import time


class Echo:
    stop = ("</call>",)

    def reset(self, problem):
        self.answer = problem["answer"]

    def step(self, turn):
        return f"<seen>{turn[-12:]}</seen>", 0.25, "done" in turn


class Hangs(Echo):
    def step(self, turn):
        time.sleep(3600)


class Crashes(Echo):
    def step(self, turn):
        os._exit(3)


class Floods(Echo):
    def step(self, turn):
        print("x" * 2_000_000)  # a megabyte and more on stdout
        return "y" * 2_000_000, 0.0, False


class OpensFiles(Echo):
    def step(self, turn):
        with open("/etc/hostname") as f:
            return f.read(), 0.0, False


class OpensSockets(Echo):
    def step(self, turn):
        socket.socket(socket.AF_INET, socket.SOCK_STREAM).connect(("127.0.0.1", 9))
        return "connected", 0.0, False


class Shells(Echo):
    def step(self, turn):
        os.system("touch /tmp/rlhf-sandbox-escaped")
        return "ran", 0.0, False


class Eats(Echo):
    def step(self, turn):
        hog = bytearray(4 << 30)  # 4 GiB, past the memory cap
        return str(len(hog)), 0.0, False


class WrongType(Echo):
    def step(self, turn):
        return 42, 0.0, False


class NoStep:
    def reset(self, problem):
        pass
