"""Typed request bodies (pydantic). A body of the wrong shape is 422 naming the field (webui.app)."""

from __future__ import annotations

from typing import Any, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field


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


class Generate(_Body):
    prompts: Optional[list[str]] = None  # blank: the job's sample prompts
    checkpoint: Optional[str] = None  # a trained file of the job (output/NAME); blank: the newest
    steps: Optional[int] = Field(None, ge=1, le=1000)
    width: Optional[int] = Field(None, ge=16, le=8192)
    height: Optional[int] = Field(None, ge=16, le=8192)
    seed: Optional[int] = Field(None, ge=0, le=2**32 - 1)


class DataRoot(_Body):
    path: str


class RawSettings(_Body):
    config: str  # config.toml as text (the UI's own keys are set again on write)
    dataset: str  # dataset.toml as text


class Caption(_Body):
    folder: str  # inside the data roots, or a job's folder
    captioner: Literal["wd14", "blip", "git"]
    model: str  # local model folder (see webui/captioning.py)
    caption_extension: Optional[str] = Field(None, pattern=r"^\.[A-Za-z0-9_]{1,16}$")
    recursive: bool = False
    overwrite: bool = False
    threshold: Optional[float] = Field(None, gt=0, lt=1)
    batch_size: Optional[int] = Field(None, ge=1, le=256)
