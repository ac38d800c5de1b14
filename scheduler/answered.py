"""The replies the scheduler gave, by (sender, request id): a node re-sends a
request it got no answer to (`cluster.retry_s`; at once when its socket
reconnected to a restarted scheduler), and a request the scheduler already
handled — its reply was lost, or slow — is answered with the first reply
instead of being handled twice (an evaluation counted twice, a second node id
for one REGISTER). The shards' `ps/retry_cache.py` keeps one push per worker;
this keeps the newest LIMIT requests of any node, since REGISTER comes before
the node has an id (`src` 0 for all) and request ids are unique per process
(proto/rpc.py draws their start at random). Lost with the scheduler: a
restarted one handles a re-sent request anew. Not thread-safe: the
coordinator's loop owns it."""

from __future__ import annotations

from collections import OrderedDict

from hetps.proto.messages import Message

LIMIT = 4096  # far more than the nodes of a cluster have in flight


class AnsweredRequests:
    def __init__(self, limit: int = LIMIT):
        self.limit = limit
        self.replies: OrderedDict[tuple[int, int], Message] = OrderedDict()
        self.retried = 0  # re-sent requests answered from here

    def answer(self, src: int, req_id: int) -> Message | None:
        """The reply already given to `src`'s request `req_id` (counted in `retried`), or None."""
        reply = self.replies.get((src, req_id))
        if reply is not None:
            self.retried += 1
        return reply

    def remember(self, src: int, req_id: int, reply: Message) -> None:
        """`reply` answered `src`'s request `req_id`; the oldest entry goes past `limit`."""
        self.replies[(src, req_id)] = reply
        if len(self.replies) > self.limit:
            self.replies.popitem(last=False)
