"""How the served model scores a (query, document) pair (``/rerank``, ``/v1/rerank``, ``/v2/rerank``,
``/score``; mindie/api/rerank.py), read once at start from the checkpoint and ``ModelConfig.rerank``:

- a **cross-encoder**: a sequence-classification checkpoint (``config.json`` ``architectures``
  names ``*ForSequenceClassification``, its ``score`` head served in place of the LM head;
  workers/models/config.py ``num_labels``). The pair is encoded as the model's tokenizer pairs
  two texts (``tokenizer.json``'s post-processor: ``<s> A <s> B`` for a Llama tokenizer, plain
  concatenation for Qwen's), and the score is the sigmoid of the last token's logit (num_labels 1),
  as sentence-transformers' CrossEncoder and vLLM compute it;
- a **decoder reranker** (Qwen3-Reranker style): a causal LM asked, by a prompt template, whether
  the document answers the query; the score is ``softmax([logit("no"), logit("yes")])[1]`` at the
  prompt's last position. Chosen by ``ModelConfig.rerank: "yes-no"`` (with ``rerankTemplate``, by
  default Qwen3-Reranker's), or by the checkpoint itself when its ``config.json`` declares
  ``classifier_from_token: ["no", "yes"]`` (vLLM's key for such checkpoints).

Anything else cannot rerank: the routes answer 400 with ``Scorer.why``, which names the key to set.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mindie.text.detokenizer import TextTokenizer

CLASSIFIER_SUFFIX = "ForSequenceClassification"  # workers/models/config.py's, read here without torch
# Qwen3-Reranker's prompt (its model card), the instruction filled in: {query} and {document} are
# replaced per pair. The answer it asks for is the next token: "yes" or "no".
DEFAULT_INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"
QWEN3_RERANKER_TEMPLATE = (
    "<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and the Instruct "
    "provided. Note that the answer can only be \"yes\" or \"no\".<|im_end|>\n<|im_start|>user\n"
    f"<Instruct>: {DEFAULT_INSTRUCTION}\n<Query>: {{query}}\n<Document>: {{document}}<|im_end|>\n"
    "<|im_start|>assistant\n<think>\n\n</think>\n\n")
YES_NO = ("no", "yes")  # the order of the logits the worker returns (wire.SamplingParams.score_tokens)


@dataclass(frozen=True)
class Scorer:
    """The served model's scoring rule (``kind`` "" = it cannot score: ``why`` says what is missing)."""

    kind: str  # "classifier" | "yes-no" | ""
    source: str  # where the rule came from (logged)
    why: str = ""
    template: str = ""  # yes-no: the prompt, with {query} and {document}
    tokens: tuple[int, ...] = ()  # yes-no: the ids of "no" and "yes" (the logits the worker returns)

    def pair_ids(self, tok: TextTokenizer, query: str, document: str) -> list[int]:
        """The prompt ids of one pair."""
        if self.kind == "classifier":
            return tok.tokenizer.encode(query, document, add_special_tokens=True).ids
        return tok.encode(self.template.replace("{query}", query).replace("{document}", document))

    def score(self, logits: Any) -> float:
        """The relevance score in [0, 1] of the worker's logits: sigmoid of the head's one logit, or
        the softmax over (no, yes) at "yes" (= sigmoid(yes - no))."""
        x = float(logits[0]) if self.kind == "classifier" else float(logits[1]) - float(logits[0])
        return 1.0 / (1.0 + math.exp(-x)) if x >= 0 else math.exp(x) / (1.0 + math.exp(x))

    @property
    def generation_refusal(self) -> str:
        """Why this model cannot generate ("" = it can): a cross-encoder has no LM head."""
        if self.kind != "classifier":
            return ""
        return (f"the served model is a sequence-classification model ({self.source}): it has no language-model "
                "head, so it serves /rerank, /v1/rerank, /v2/rerank, /score and embeddings only, not generation")


def _read(path: Path) -> dict:
    try:
        d = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return d if isinstance(d, dict) else {}


def _token_id(tok: TextTokenizer, word: str, where: str) -> int:
    """The one id of ``word`` (its vocabulary entry, else its encoding without special tokens)."""
    i = tok.tokenizer.token_to_id(word)
    if i is None:
        ids = tok.tokenizer.encode(word, add_special_tokens=False).ids
        if len(ids) != 1:
            raise ValueError(f"{where}: the reranker's answer token {word!r} is not one token of the model's "
                             f"tokenizer ({ids})")
        i = ids[0]
    return i


def load_scorer(model_dir: str | Path, tok: TextTokenizer, configured: str = "auto", template: str = "") -> Scorer:
    """The scoring rule of the checkpoint in ``model_dir`` with ``ModelConfig.rerank`` (``configured``:
    "auto", "yes-no" or "off") and ``ModelConfig.rerankTemplate`` (``template``; "" = Qwen3-Reranker's).
    Raises ValueError for a configuration that cannot be served (named)."""
    cfg = _read(Path(model_dir) / "config.json")
    archs = [str(a) for a in cfg.get("architectures") or []]
    classifier = next((a for a in archs if a.endswith(CLASSIFIER_SUFFIX)), "")
    declared = cfg.get("classifier_from_token")
    if template and ("{query}" not in template or "{document}" not in template):
        raise ValueError("ModelConfig.rerankTemplate must contain {query} and {document}")
    if configured == "off":
        return Scorer("", "ModelConfig.rerank", why="rerank is off for this model (ModelConfig.rerank: \"off\")")
    if classifier:
        if configured == "yes-no":
            raise ValueError(f"ModelConfig.rerank \"yes-no\" needs a causal LM; the checkpoint is a {classifier}")
        labels = cfg.get("id2label")
        n = len(labels) if isinstance(labels, dict) and labels else cfg.get("num_labels", 2)
        if n != 1:
            return Scorer("", f"config.json architectures {classifier}",
                          why=f"the model's classification head has {n} labels (num_labels); a relevance score "
                              "is served from a one-logit head (num_labels 1)")
        return Scorer("classifier", f"config.json architectures {classifier}")
    if configured == "yes-no" or declared is not None:
        words = YES_NO
        source = "ModelConfig.rerank \"yes-no\""
        if configured != "yes-no":
            if not (isinstance(declared, list) and len(declared) == 2 and all(isinstance(w, str) for w in declared)):
                raise ValueError(f"{model_dir}/config.json: classifier_from_token must be two tokens "
                                 f"[\"no\", \"yes\"], got {declared!r}")
            words, source = tuple(declared), "config.json classifier_from_token"
        tokens = tuple(_token_id(tok, w, source) for w in words)
        return Scorer("yes-no", source, template=template or QWEN3_RERANKER_TEMPLATE, tokens=tokens)
    return Scorer("", "", why=(
        "the served model cannot rerank: it is a causal LM with neither a sequence-classification head "
        "(config.json architectures *ForSequenceClassification) nor a reranker prompt; set ModelConfig.rerank "
        "to \"yes-no\" to serve it as a Qwen3-Reranker-style decoder reranker (docs/apis.md, \"Rerank and score\")"))
