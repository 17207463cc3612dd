"""AT2PO's entropy-guided expansion inside the trainer (A1–A2): the highest node score wins, the sibling penalty
moves the next round elsewhere, and every re-sampled turn becomes a sibling of the turn it was chosen for."""

import re

import torch

from tests.scripted import captured_units, scripted_trainer, tool_call
from trl_tree import AT2POConfig, AT2POTrainer
from trl_tree.core.batch import TurnCredit

# turn -> (text, entropy); after a call the next turn is chosen by the expression of the last call in the history
X, Z, X2 = tool_call("calculator", expression="1+1"), tool_call("calculator", expression="2+2"), \
    tool_call("calculator", expression="5+5")
Y, Y2 = tool_call("calculator", expression="3+3"), tool_call("calculator", expression="7+7")
ENTROPY = {X: 1.0, Z: 0.5, X2: 0.1, Y: 0.93, Y2: 0.2}
FIRST_TURNS = [X, Z, X2]  # the two initial trajectories, then round 1's re-sample of the prompt's child
AFTER = {"1+1": [Y, Y2], "2+2": ["The answer is 4."], "5+5": ["The answer is 10."], "3+3": ["The answer is 2."],
         "7+7": ["The answer is 14."]}


class ByLastCall:
    """Replies with the first turns in order while the history has no call, then by the expression of its last call
    (each list in order); every token of a reply has its text's entropy."""

    def __init__(self, tok):
        self.tok, self.eos = tok, tok.convert_tokens_to_ids("<|im_end|>")
        self.first, self.after = list(FIRST_TURNS), {k: list(v) for k, v in AFTER.items()}

    def __call__(self, prefix):
        calls = re.findall(r'"expression": "([^"]+)"', self.tok.decode(prefix).split("<|im_start|>user\nWhat is")[-1])
        text = self.first.pop(0) if not calls else self.after[calls[-1]].pop(0)
        ids = self.tok.encode(text, add_special_tokens=False) + [self.eos]
        return ids, [ENTROPY.get(text, 0.0)] * len(ids)


def test_entropy_guided_rounds_pick_by_score_and_branch_siblings(tmp_path):
    trainer = scripted_trainer(AT2POTrainer, AT2POConfig, tmp_path, script=ByLastCall, num_initial_rollouts=2,
                               expansion_rounds=2, branches_per_round=1, max_turns=4, max_completion_length=400)
    units = captured_units(trainer)
    batch = trainer.generate_batch([trainer.train_dataset[0]])
    tree, tok = units[0], trainer.processing_class
    index = {tok.decode(t.action_ids[:-1]): i for i, t in enumerate(tree.turns)}
    # round 1: S_X = 1.0 − 0.05·(2−1) beats S_Y = 0.93 (Y has no sibling): X is re-sampled as a sibling of X
    assert tree.turns[index[X2]].parent == tree.turns[index[X]].parent == -1
    # round 2: X now has 2 siblings, S_X = 1.0 − 0.1 = 0.90 < S_Y = 0.93: Y is re-sampled, as a sibling of Y
    assert tree.turns[index[Y2]].parent == tree.turns[index[Y]].parent == index[X]
    assert tree.num_leaves == 2 + 2 * 1
    # the credit is a softmax over child entropies (A4) and every turn has a finite advantage
    assert torch.isfinite(TurnCredit.from_dict(batch).A).all()
