"""The decoder's tensors inside a multimodal checkpoint (Gemma3ForConditionalGeneration,
Gemma4ForConditionalGeneration), whose text part is what the server serves.

transformers (4.52 and later) saves the decoder under ``model.language_model.`` and the towers
beside it (``model.vision_tower.``, ``model.multi_modal_projector.``; Gemma 4 also
``model.audio_tower.``, ``model.embed_vision.``, ``model.embed_audio.``); earlier saves, as most
published Gemma 3 checkpoints, put it under ``language_model.model.`` with ``language_model.lm_head.``
and the towers at the top level. ``text_key`` takes a name as workers/models/checkpoint.py has
prefixed it (``model.`` added to names without it) and gives the text model's name, or None for a
tower's tensor (not loaded: counted and logged by the loader). Torch-free."""
from __future__ import annotations

__all__ = ["TOWERS", "text_key"]

TOWERS = ("model.vision_tower.", "model.audio_tower.", "model.embed_vision.", "model.embed_audio.",
          "model.multi_modal_projector.")
# (prefix as checkpoint.py sees it, the text model's prefix), most specific first
_TEXT = (("model.language_model.model.", "model."), ("model.language_model.lm_head.", "lm_head."),
         ("model.language_model.", "model."))


def text_key(key: str) -> str | None:
    """The text model's name of checkpoint tensor ``key``; None: a tower's tensor."""
    if key.startswith(TOWERS):
        return None
    for old, new in _TEXT:
        if key.startswith(old):
            return new + key[len(old):]
    return key
