from setuptools import find_packages, setup

setup(
    name="lora-trainer-toolkit",
    version="0.1.0",
    description="LoRA / LyCORIS and fine-tune training for SD 1.x/2.x, SDXL and FLUX.1, sd-scripts compatible",
    packages=find_packages(include=["library", "library.*", "networks", "networks.*"]),
    python_requires=">=3.10",
    install_requires=[line.strip() for line in open("requirements.txt") if line.strip() and not line.startswith("#")],
)
