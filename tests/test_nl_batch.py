"""The batched netlink transport (nl.RtnlSocket.transact) against a scripted kernel: only the last
request of each sendmsg asks for an ack, every refusal still lands on its own request, and a
chunk never holds more requests than the receive buffer can answer with errors."""
import errno
import struct

import pytest

from flowpacer.kernel.tc import nl

HDR = struct.Struct("=IHHII")


class ScriptedKernel:
    """Stands in for the netlink socket: parses each sendmsg like rtnetlink does (in order,
    an error for each refused request, an ack only where NLM_F_ACK asks for one) and queues the
    answers, one datagram per sendmsg."""

    def __init__(self, refuse=(), extack=b"no such class\0"):
        self.refuse = set(refuse)       # request numbers (0-based, over the whole test) refused
        self.extack = extack
        self.sent = []                  # per sendmsg: [(flags, seq, body)]
        self.queue = []
        self.n = 0

    def sendall(self, data: bytes) -> None:
        off, msgs, out = 0, [], bytearray()
        while off < len(data):
            mlen, mtype, flags, seq, pid = HDR.unpack_from(data, off)
            msgs.append((flags, seq, data[off + HDR.size: off + mlen]))
            refused = self.n in self.refuse
            self.n += 1
            if refused or flags & nl.NLM_F_ACK:
                err = -errno.ENOENT if refused else 0
                payload = struct.pack("=i", err) + HDR.pack(mlen, mtype, flags, seq, pid)
                eflags = nl.NLM_F_CAPPED
                if refused and self.extack:
                    eflags |= nl.NLM_F_ACK_TLVS
                    payload += nl.nla(nl.NLMSGERR_ATTR_MSG, self.extack)
                out += HDR.pack(HDR.size + len(payload), nl.NLMSG_ERROR, eflags, seq, 0) + payload
            off += (mlen + 3) & ~3
        self.sent.append(msgs)
        if out:
            self.queue.append(bytes(out))

    def recv(self, _n):
        assert self.queue, "transact waits for an answer the kernel never sends"
        return self.queue.pop(0)

    def recv_into(self, buf):
        data = self.recv(len(buf))
        buf[:len(data)] = data
        return len(data)

    def close(self):
        pass


def rtnl(kernel, max_in_flight=16, batch_bytes=None):
    s = nl.RtnlSocket.__new__(nl.RtnlSocket)
    s._sock = kernel
    s._seq = 1000
    s._buf = None
    s.max_in_flight = max_in_flight
    if batch_bytes is not None:
        s.BATCH_BYTES = batch_bytes
    return s


def reqs(n, size=40):
    return [nl.Request(nl.RTM_NEWTCLASS, nl.NLM_F_CREATE, bytes(size), f"add class {i}")
            for i in range(n)]


@pytest.mark.parametrize("n", [1, 2, 15, 16, 17, 50])
def test_one_ack_per_sendmsg_and_every_refusal_on_its_request(n):
    refuse = {0, 7, n - 1} & set(range(n))
    k = ScriptedKernel(refuse)
    out = rtnl(k).transact(reqs(n))
    assert [i for i, e in enumerate(out) if e is not None] == sorted(refuse)
    for i in refuse:
        assert out[i].errno == errno.ENOENT and "add class %d" % i in str(out[i])
        assert "no such class" in str(out[i])
    # chunks of at most max_in_flight requests, the last of each (only) asking for an ack
    assert sum(len(c) for c in k.sent) == n
    for chunk in k.sent:
        assert 1 <= len(chunk) <= 16
        acks = [bool(f & nl.NLM_F_ACK) for f, _, _ in chunk]
        assert acks == [False] * (len(chunk) - 1) + [True]
        assert all(f & nl.NLM_F_REQUEST and f & nl.NLM_F_CREATE for f, _, _ in chunk)
    seqs = [s for c in k.sent for _, s, _ in c]
    assert len(set(seqs)) == n


def test_chunks_are_cut_by_bytes_too():
    k = ScriptedKernel({3})
    out = rtnl(k, max_in_flight=1000, batch_bytes=200).transact(reqs(10, size=60))
    assert [i for i, e in enumerate(out) if e] == [3]
    assert all(sum(HDR.size + len(b) for _, _, b in c) <= 200 + HDR.size + 60 for c in k.sent)
    assert len(k.sent) > 1
    assert all(c[-1][0] & nl.NLM_F_ACK and not any(f & nl.NLM_F_ACK for f, _, _ in c[:-1])
               for c in k.sent)


def test_a_whole_chunk_refused_and_a_stale_answer_ignored():
    k = ScriptedKernel(set(range(40)), extack=b"")
    s = rtnl(k)
    k.queue.append(HDR.pack(36, nl.NLMSG_ERROR, 0, 999, 0) + struct.pack("=i", -1) + bytes(16))
    out = s.transact(reqs(40))
    assert all(e is not None and e.errno == errno.ENOENT for e in out)
    assert s.transact([]) == []
