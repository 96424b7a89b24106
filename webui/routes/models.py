"""Typed request bodies (pydantic). A body of the wrong shape is 422 naming the field (webui.app)."""

from __future__ import annotations

from typing import Any, Optional

from pydantic import BaseModel, ConfigDict


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class NewJob(_Body):
    template: str
    name: Optional[str] = None
    launcher: Optional[str] = None


class JobChanges(_Body):
    name: Optional[str] = None
    launcher: Optional[str] = None


class Duplicate(_Body):
    name: Optional[str] = None


class Settings(_Body):
    config: Optional[dict[str, Any]] = None
    dataset: Optional[dict[str, Any]] = None
    prompts: Optional[list[str]] = None
    launch: Optional[dict[str, Any]] = None

    def as_settings(self) -> dict[str, Any]:
        return {"config": self.config or {}, "dataset": self.dataset or {}, "prompts": self.prompts or [],
                "launch": self.launch or {}}
