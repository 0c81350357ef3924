"""Questions about the autograd graph that more than one part of zeroshard asks."""
import collections

# (first, end) autograd sequence numbers of recent checkpointed forwards (zeroshard.checkpointing):
# their nodes' saved tensors are recomputed by every backward that reaches them.
_RECOMPUTED = collections.deque(maxlen=4096)


def note_recomputed_segment(first, end):
    if end > first:
        _RECOMPUTED.append((first, end))


def in_recomputed_segment(sequence_nr):
    """Whether the autograd node with this sequence number was made by a checkpointed forward."""
    return any(first <= sequence_nr < end for first, end in _RECOMPUTED)


def lowest_nodes_created(tensors, start, end):
    """Of the autograd nodes created with sequence numbers start..end-1 on this thread, found from
    `tensors` back, those with no such node below them. None when some of those nodes cannot be
    found that way (an intermediate result kept aside or thrown away, an in-place op's inner
    node), so that nothing says when they run."""
    found, lowest = set(), []
    stack = [t.grad_fn for t in tensors if t.grad_fn is not None]
    while stack:
        node = stack.pop()
        seq = node._sequence_nr()  # AccumulateGrad's is 2**64 - 1
        if not start <= seq < end or seq in found:
            continue
        found.add(seq)
        below = [n for n, _ in node.next_functions
                 if n is not None and start <= n._sequence_nr() < end]
        if not below:
            lowest.append(node)
        stack.extend(below)
    return lowest if len(found) == end - start else None
