"""Zero bubble's split of one stage's backward into B (the inputs' gradient, which the previous
stage waits for) and W (the weights', run later to fill the bubble), over the graph the forward
recorded, W not repeating B's work (see backward_input)."""

import torch
from torch.autograd.graph import GradientEdge

from zeroshard.graph import in_recomputed_segment


class WeightPass:
    """What B leaves for W: one replay per owner (where to start, with which gradients, for which
    weights)."""

    def __init__(self, replays):
        self._replays = replays  # [(starts: list, grads: list, weights: list)]

    def run(self):
        """Accumulates the weights' gradients into .grad (the engine's hooks see them as from any
        backward). Each replay runs its own subgraph once, so it frees what it used."""
        for starts, grads, weights in self._replays:
            if starts:
                torch.autograd.backward(starts, grads, inputs=weights)
        self._replays = []


def _children(node):
    return [child for child, _ in node.next_functions if child is not None]


def _leaf_of(node):
    """The tensor an AccumulateGrad node accumulates into, or None for other nodes."""
    return getattr(node, "variable", None)


def _walk(roots):
    """Every node under the roots, each after all of its children (iterative: graphs are deep)."""
    order, seen, stack = [], set(), [(node, False) for node in roots]
    while stack:
        node, expanded = stack.pop()
        if expanded:
            order.append(node)
            continue
        if node in seen:
            continue
        seen.add(node)
        stack.append((node, True))
        stack.extend((child, False) for child in _children(node) if child not in seen)
    return order


class _Graph:
    """The graph under a stage's outputs, split into the input path and the weights' subgraphs."""

    def __init__(self, root_nodes, inputs):
        input_ids = {id(x) for x in inputs}
        self.nodes = _walk(root_nodes)
        self.on_input_path = set()
        self.weights_under = {}  # node off the input path -> {id: weight} it leads to
        for node in self.nodes:  # children first
            leaf = _leaf_of(node)
            if leaf is not None:
                if id(leaf) in input_ids:
                    self.on_input_path.add(node)
                else:
                    self.weights_under[node] = {id(leaf): leaf}
                continue
            children = _children(node)
            if any(child in self.on_input_path for child in children):
                self.on_input_path.add(node)
            else:
                below = {}
                for child in children:
                    below.update(self.weights_under[child])
                self.weights_under[node] = below

    def owned_weights(self, node):
        """The weights an input-path node leads to through children off the path."""
        out = {}
        for child in _children(node):
            if child not in self.on_input_path:
                out.update(self.weights_under[child])
        return out


def backward_input(roots, grads, inputs):
    """B: accumulates the input gradients into each input's .grad (and, into .grad, the whole
    gradient of weights W cannot replay exactly); returns the WeightPass that completes the
    backward. roots: the outputs that require grad; grads: their gradients (None for a scalar
    loss); inputs: the stage's input leaves that require grad.

    The graph's nodes that lead to the stage's inputs (the input path) all run in B. Some of them
    also lead to weights off that path, a matmul's backward being the usual one: it computes its
    input's gradient for B and its weight's for W. B keeps the gradient that reached each such node
    (its owner: the last node on the input path before the weight's own subgraph), and W runs each
    owner again from that gradient, asking autograd for that owner's weights only, so that W costs the
    weight half of the backward instead of a second whole backward.

    A weight under two owners (a module called twice, one tensor used in two places of the chunk)
    could be reached by one owner's replay through the other owner's input path and be counted twice;
    such weights get their whole gradient in B instead, which is exact (B then just does their work).
    So do the weights of a segment checkpointed with zeroshard.checkpointing, whose replay would
    recompute the segment (torch recomputes once per backward call); a segment checkpointed with
    torch.utils.checkpoint directly is exact too, but recomputed in each replay that reaches it."""
    graph = _Graph([r.grad_fn for r in roots if r.grad_fn is not None], inputs)
    if any(type(node).__name__ == "CheckpointFunctionBackward" for node in graph.nodes):
        raise ValueError("pipeline.schedule zero_bubble: the stage runs a reentrant activation "
                         "checkpoint (torch.utils.checkpoint with use_reentrant=True), whose "
                         "backward cannot be split into input and weight passes; use "
                         "zeroshard.checkpointing.checkpoint (DeepSpeed's deepspeed.checkpointing) "
                         "or use_reentrant=False, or another schedule")
    # Owners: input-path nodes with weights off the path, and the outputs that do not reach the
    # inputs at all (their whole subgraph is the weights').
    owners = {}  # owner (node, or root index) -> {id: weight}
    for node in graph.nodes:
        if node in graph.on_input_path:
            weights = graph.owned_weights(node)
            if weights:
                owners[node] = weights
    for i, root in enumerate(roots):
        node = root.grad_fn
        if node is None:  # a weight returned as it is: its gradient is the output's
            owners[i] = {id(root): root} if id(root) not in {id(x) for x in inputs} else {}
        elif node not in graph.on_input_path:
            owners[i] = dict(graph.weights_under[node])
    count = {}
    for weights in owners.values():
        for key in weights:
            count[key] = count.get(key, 0) + 1
    shared = {}
    for owner, weights in owners.items():
        # A node of a checkpointed segment: replaying it in W would recompute the segment again
        # (torch recomputes once per backward call), so its weights are done in B.
        recomputed = not isinstance(owner, int) and in_recomputed_segment(owner._sequence_nr())
        shared.update({key: w for key, w in weights.items() if count[key] > 1 or recomputed})

    captured = {}
    handles = []
    for owner in owners:
        if not isinstance(owner, int) and any(key not in shared for key in owners[owner]):
            handles.append(owner.register_prehook(lambda grad_outputs, owner=owner: captured.__setitem__(owner, grad_outputs)))
    targets = list(inputs) + list(shared.values())
    try:
        if targets:
            torch.autograd.backward(roots, grads if grads[0] is not None else None,
                                    inputs=targets, retain_graph=True)
    finally:
        for handle in handles:
            handle.remove()

    replays = []
    for owner, weights in owners.items():
        own = [w for key, w in weights.items() if key not in shared]
        if not own:
            continue
        if isinstance(owner, int):
            replays.append(([roots[owner]], [grads[owner]], own))
            continue
        grad_outputs = captured.get(owner)
        if grad_outputs is None:  # no gradient reached it (an output that does not matter)
            continue
        starts = [GradientEdge(owner, k) for k, g in enumerate(grad_outputs) if g is not None]
        replays.append((starts, [g for g in grad_outputs if g is not None], own))
    return WeightPass(replays)
