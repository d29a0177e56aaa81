"""The input rules of trainmem/trace/diffusers_inputs.py added for the classes the coverage
benchmark refused (issue 26): each stand-in below has the class name, the config fields and the
forward signature of the diffusers class (diffusers 0.42), with toy widths; the expected shapes
are derived by hand from the class's forward docstring and its pipeline (comments), not read
from the rules. The classes themselves are built, traced and estimated by
``benchmarks/coverage.py diffusers``."""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")

from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: E402

from trainmem.errors import UnsupportedError  # noqa: E402
from trainmem.specs.training import TrainingConfig  # noqa: E402
from trainmem.trace.diffusers_inputs import forward_inputs  # noqa: E402
from trainmem.trace.known_values import value_of  # noqa: E402

F32, I64 = torch.float32, torch.int64


def stand_in(name: str, forward: Any, **config: Any) -> Any:
    """A module with ``name``'s config and ``forward``'s signature (one fp32 parameter)."""
    cls = type(name, (torch.nn.Module,), {"forward": forward})
    model = cls()
    model.proj = torch.nn.Linear(2, 2)
    model.config = {"_class_name": name, **config}
    return model


def batch(model: Any, **settings: Any) -> dict[str, Any]:
    training = TrainingConfig(micro_batch_size=2, **settings)
    with FakeTensorMode():
        return forward_inputs(model, training)


def shape(t: Any) -> tuple[tuple[int, ...], Any]:
    return tuple(t.shape), t.dtype


def test_animatediff_motion_unet_takes_the_prompt_once_per_frame() -> None:
    # pipeline_animatediff.py: prompt_embeds.repeat_interleave(repeats=num_frames, dim=0); the
    # UNet folds frames into the batch. 16 frames (AnimateDiff's default), 2 samples -> 32
    def forward(self, sample, timestep, encoder_hidden_states, return_dict=True): ...

    model = stand_in("UNetMotionModel", forward, in_channels=4, sample_size=8,
                     cross_attention_dim=32)  # fmt: skip
    got = batch(model, text_seq_len=5)
    assert shape(got["sample"]) == ((2, 4, 16, 8, 8), F32)
    assert shape(got["encoder_hidden_states"]) == ((32, 5, 32), F32)


def test_joyimage_edit_plus_takes_its_latent_as_patches() -> None:
    # transformer_joyimage_edit_plus.py: hidden_states [B, max_patches, C, pt, ph, pw];
    # pipeline prepare_latents: one target image, 64 px / 8 = 8 x 8 latent, patch (1, 2, 2):
    # 4 x 4 = 16 patches, shape_list [(1, 4, 4)] per sample
    def forward(
        self,
        hidden_states,
        timestep,
        encoder_hidden_states,
        encoder_hidden_states_mask=None,
        shape_list=None,
        return_dict=True,
    ): ...

    model = stand_in("JoyImageEditPlusTransformer3DModel", forward, patch_size=[1, 2, 2],
                     in_channels=16, text_dim=24)  # fmt: skip
    got = batch(model, resolution=64, text_seq_len=5)
    assert shape(got["hidden_states"]) == ((2, 16, 16, 1, 2, 2), F32)
    assert got["shape_list"] == [[(1, 4, 4)], [(1, 4, 4)]]
    assert shape(got["encoder_hidden_states"]) == ((2, 5, 24), F32)


def test_bria_fibo2_takes_one_text_bundle_per_injection_block_and_the_perceiver() -> None:
    # transformer_bria_fibo2.py: encoder_hidden_states (batch, 1 + len(injection_layer_ids),
    # text_len, cap_feat_dim)
    def forward(
        self,
        hidden_states,
        timestep,
        encoder_hidden_states,
        encoder_attention_mask=None,
        context_latents=None,
        return_dict=True,
    ): ...

    model = stand_in("BriaFibo2Transformer2DModel", forward, in_channels=16, cap_feat_dim=24,
                     injection_layer_ids=[1, 3], patch_size=2)  # fmt: skip
    got = batch(model, resolution=64, text_seq_len=5)
    assert shape(got["encoder_hidden_states"]) == ((2, 3, 5, 24), F32)
    assert shape(got["hidden_states"]) == ((2, 16, 8, 8), F32)


def test_sana_wm_takes_per_frame_timesteps_and_a_prompt_axis() -> None:
    # transformer_sana_wm.py: timestep (B, 1, T) per latent frame, encoder_hidden_states
    # (B, 1, L, D); a video class without a row: 17 frames, temporal factor 4 -> 5 latent frames
    def forward(
        self,
        hidden_states,
        timestep,
        encoder_hidden_states,
        encoder_attention_mask=None,
        mask=None,
        return_dict=True,
    ): ...

    model = stand_in("SanaWMTransformer3DModel", forward, in_channels=16, caption_channels=24,
                     sample_size=8)  # fmt: skip
    got = batch(model, text_seq_len=5)
    assert shape(got["hidden_states"]) == ((2, 16, 5, 8, 8), F32)
    assert shape(got["timestep"]) == ((2, 1, 5), F32)
    assert shape(got["encoder_hidden_states"]) == ((2, 1, 5, 24), F32)


def test_glm_image_takes_one_known_prior_token_per_patch() -> None:
    # pipeline_glm_image.py: prior ids upsampled to the patch grid, prior_token_drop_cond all
    # False; 64 px / 8 = 8 x 8 latent, patch 2 -> 16 ids per sample
    def forward(
        self,
        hidden_states,
        encoder_hidden_states,
        prior_token_id,
        prior_token_drop,
        timestep,
        target_size,
        crop_coords,
        return_dict=True,
    ): ...

    model = stand_in("GlmImageTransformer2DModel", forward, in_channels=16, patch_size=2,
                     text_embed_dim=24)  # fmt: skip
    got = batch(model, resolution=64, text_seq_len=5)
    assert shape(got["prior_token_id"]) == ((2, 16), I64)
    assert value_of(got["prior_token_id"]).tolist() == [[0] * 16] * 2
    assert value_of(got["prior_token_drop"]).tolist() == [[False] * 16] * 2


def test_framepack_takes_its_image_states_and_the_clean_history() -> None:
    # pipeline_hunyuan_video_framepack.py: a 9-latent-frame window (33 frames, temporal 4),
    # SigLIP states [b, 729, image_proj_dim], history_sizes [1, 2, 16]: latents_clean = the
    # first frame + 1, 2x history 2 frames, 4x history 16; indices one-dimensional aranges
    def forward(
        self,
        hidden_states,
        timestep,
        encoder_hidden_states,
        encoder_attention_mask,
        pooled_projections,
        image_embeds,
        indices_latents,
        guidance=None,
        latents_clean=None,
        indices_latents_clean=None,
        latents_history_2x=None,
        indices_latents_history_2x=None,
        latents_history_4x=None,
        indices_latents_history_4x=None,
        return_dict=True,
    ): ...

    model = stand_in("HunyuanVideoFramepackTransformer3DModel", forward, in_channels=16,
                     has_image_proj=True, image_proj_dim=12, has_clean_x_embedder=True,
                     text_embed_dim=24, pooled_projection_dim=8, patch_size=2)  # fmt: skip
    got = batch(model, resolution=64, text_seq_len=5)
    assert shape(got["hidden_states"]) == ((2, 16, 9, 8, 8), F32)
    assert shape(got["image_embeds"]) == ((2, 729, 12), F32)
    assert value_of(got["indices_latents"]).tolist() == list(range(9))
    for key, frames in (("latents_clean", 2), ("latents_history_2x", 2),
                        ("latents_history_4x", 16)):  # fmt: skip
        assert shape(got[key]) == ((2, 16, frames, 8, 8), F32)
        assert value_of(got["indices_" + key]).tolist() == list(range(frames))
    model.config["has_clean_x_embedder"] = False  # no history without its embedder
    assert "latents_clean" not in batch(model, resolution=64, text_seq_len=5)


def test_ltx2_takes_the_audio_latents_of_the_clip() -> None:
    # pipeline_ltx2.py: audio latents = round(frames / 24 fps * 16000 / 160 / 4): 9 frames ->
    # round(9.375) = 9; video: 32x spatial, 8x temporal VAE: 64 px -> 2 x 2, 9 frames -> 2
    # latent frames, one token per latent pixel: 8 tokens
    def forward(
        self,
        hidden_states,
        audio_hidden_states,
        encoder_hidden_states,
        audio_encoder_hidden_states,
        timestep,
        num_frames=None,
        height=None,
        width=None,
        audio_num_frames=None,
        return_dict=True,
    ): ...

    model = stand_in("LTX2VideoTransformer3DModel", forward, in_channels=32, caption_channels=24,
                     audio_in_channels=16, audio_sampling_rate=16000, audio_hop_length=160,
                     audio_scale_factor=4)  # fmt: skip
    got = batch(model, resolution=64, frames=9, text_seq_len=5)
    assert shape(got["hidden_states"]) == ((2, 8, 32), F32)
    assert shape(got["audio_hidden_states"]) == ((2, 9, 16), F32)
    assert shape(got["audio_encoder_hidden_states"]) == ((2, 5, 24), F32)
    assert (got["num_frames"], got["height"], got["width"], got["audio_num_frames"]) == (2, 2, 2, 9)


def test_anyflow_far_takes_its_chunk_partition_when_it_covers_the_frames() -> None:
    # pipeline_anyflow_far.py: chunk_partition defaults to the config's, which must sum to the
    # latent frames; 17 frames / temporal 4 -> 5 latent frames = 1 + 2 + 2
    def forward(
        self,
        hidden_states,
        timestep,
        r_timestep,
        encoder_hidden_states,
        chunk_partition,
        return_dict=True,
    ): ...

    model = stand_in("AnyFlowFARTransformer3DModel", forward, in_channels=16, text_dim=24,
                     chunk_partition=[1, 2, 2])  # fmt: skip
    got = batch(model, resolution=64, frames=17, text_seq_len=5)
    assert got["chunk_partition"] == [1, 2, 2]
    assert shape(got["timestep"]) == ((2, 5), F32)  # one noise level per latent frame
    with pytest.raises(UnsupportedError, match="chunk_partition"):
        batch(model, resolution=64, frames=21, text_seq_len=5)  # 6 latent frames


def test_sana_wm_refiner_builds_its_rope_with_its_own_method() -> None:
    # pipelines/sana_wm/refiner.py: video_rotary_emb = transformer.
    # build_rotary_emb_for_absolute_positions(batch_size, frame_positions, height, width, device,
    # fps); LTX-2's VAE (32x spatial, 8x temporal): 64 px -> 2 x 2, 17 frames -> 3 latent frames
    calls: list[dict[str, Any]] = []

    def forward(
        self, hidden_states, encoder_hidden_states, timestep, video_rotary_emb, return_dict=True
    ): ...

    model = stand_in("SanaWMLTX2RefinerTransformer3DModel", forward, in_channels=32,
                     caption_channels=24)  # fmt: skip

    def build(**kwargs: Any) -> Any:
        calls.append(kwargs)
        return torch.zeros(1), torch.zeros(1)

    model.build_rotary_emb_for_absolute_positions = build
    got = batch(model, resolution=64, frames=17, text_seq_len=5)
    assert shape(got["hidden_states"]) == ((2, 3 * 2 * 2, 32), F32)
    (call,) = calls
    assert (call["batch_size"], call["frame_positions"], call["height"], call["width"]) == (
        2, [0, 1, 2], 2, 2,
    )  # fmt: skip
    assert call["fps"] == 24.0


def test_wan_animate_takes_pose_latents_face_pixels_and_the_reference_image() -> None:
    # pipeline_wan_animate.py, one 77-frame segment after the reference image: 81 frames of
    # latents (Wan's row) -> 21 latent frames = 1 reference + 20 segment frames; pose latents
    # (B, latent_channels, 20, h, w); face video (B, 3, 77, motion_encoder_size, same);
    # CLIP ViT-H penultimate states (B, 257, image_dim)
    def forward(
        self, hidden_states, timestep, encoder_hidden_states, encoder_hidden_states_image=None,
        pose_hidden_states=None, face_pixel_values=None, return_dict=True,
    ): ...  # fmt: skip

    model = stand_in("WanAnimateTransformer3DModel", forward, in_channels=12, latent_channels=4,
                     text_dim=24, image_dim=16, motion_encoder_size=16)  # fmt: skip
    got = batch(model, resolution=64, text_seq_len=5)
    assert shape(got["hidden_states"]) == ((2, 12, 21, 8, 8), F32)
    assert shape(got["pose_hidden_states"]) == ((2, 4, 20, 8, 8), F32)
    assert shape(got["face_pixel_values"]) == ((2, 3, 77, 16, 16), F32)
    assert shape(got["encoder_hidden_states_image"]) == ((2, 257, 16), F32)


def test_wan_vace_takes_its_conditioning_latents() -> None:
    # pipeline_wan_vace.py: control_hidden_states = the conditioning latents [B,
    # vace_in_channels, T, H, W] (video latents and mask in channels); Wan's 81 frames -> 21
    def forward(
        self, hidden_states, timestep, encoder_hidden_states, encoder_hidden_states_image=None,
        control_hidden_states=None, control_hidden_states_scale=None, return_dict=True,
    ): ...  # fmt: skip

    model = stand_in("WanVACETransformer3DModel", forward, in_channels=4, text_dim=24,
                     vace_in_channels=12, vace_layers=[0])  # fmt: skip
    got = batch(model, resolution=64, text_seq_len=5)
    assert shape(got["control_hidden_states"]) == ((2, 12, 21, 8, 8), F32)
    assert "control_hidden_states_scale" not in got  # the model's default: ones per layer
