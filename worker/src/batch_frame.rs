//! A batch as one frame on the wire: its head, then each tensor's padding and chunks, written
//! straight from the batch's buffers.

use crate::batch::{i64_bytes, Batch};
use stoker_wire::{tensor, BatchHead, BatchRequest, FrameHeader, Kind, TensorRef, HEADER_LEN};
use tokio::io::{AsyncWrite, AsyncWriteExt};

/// Values per row of the batch's video patches (the same row layout as its images').
fn pixel_dim_of(batch: &Batch, dtype: stoker_wire::DType) -> u64 {
    let bytes: u64 = (batch.video_chunks.iter())
        .map(|c| c.as_bytes().len() as u64)
        .sum();
    match batch.video_rows {
        0 => 0,
        rows => bytes / rows as u64 / dtype.size() as u64,
    }
}

/// Writes a batch frame: head, then each tensor's padding and chunks, with no staging copy.
/// `pixel_lut` (u8 pixels only) goes along as a `[3, 256]` float32 tensor, and with a video
/// `pixel_lut_videos`, the video processors' own table.
pub async fn write_batch<W: AsyncWrite + Unpin>(
    w: &mut W,
    req: BatchRequest,
    batch: &Batch,
    pixel_dtype: stoker_wire::DType,
    (pixel_lut, video_lut): (Option<&[u8]>, Option<&[u8]>),
) -> std::io::Result<u64> {
    let b = batch.rows as u64;
    let l = batch.seq_len as u64;
    let ids = i64_bytes(&batch.input_ids);
    let labels = i64_bytes(&batch.labels);
    let mask = i64_bytes(&batch.attention_mask);
    let grid = i64_bytes(&batch.image_grid_thw);
    let pixel_bytes: u64 = batch
        .pixel_chunks
        .iter()
        .map(|c| c.as_bytes().len() as u64)
        .sum();
    let row_bytes = if batch.pixel_rows == 0 {
        0
    } else {
        pixel_bytes / batch.pixel_rows as u64
    };
    let pixel_dim = row_bytes / pixel_dtype.size() as u64;
    let i64_tensor = |name, shape: Vec<u64>, bytes| TensorRef {
        name,
        dtype: stoker_wire::DType::I64,
        shape,
        chunks: vec![bytes],
    };
    let mut tensors = vec![
        i64_tensor(tensor::INPUT_IDS, vec![b, l], &ids),
        i64_tensor(tensor::LABELS, vec![b, l], &labels),
        i64_tensor(tensor::ATTENTION_MASK, vec![b, l], &mask),
        TensorRef {
            name: tensor::PIXEL_VALUES,
            dtype: pixel_dtype,
            shape: vec![batch.pixel_rows as u64, pixel_dim],
            chunks: batch.pixel_chunks.iter().map(|c| c.as_bytes()).collect(),
        },
        i64_tensor(
            tensor::IMAGE_GRID_THW,
            vec![batch.image_grid_thw.len() as u64 / 3, 3],
            &grid,
        ),
    ];
    let video_grid = i64_bytes(&batch.video_grid_thw);
    let seconds: Vec<u8> = (batch.second_per_grid_ts.iter())
        .flat_map(|s| s.to_le_bytes())
        .collect();
    if !batch.video_chunks.is_empty() {
        tensors.push(TensorRef {
            name: tensor::PIXEL_VALUES_VIDEOS,
            dtype: pixel_dtype,
            shape: vec![batch.video_rows as u64, pixel_dim_of(batch, pixel_dtype)],
            chunks: batch.video_chunks.iter().map(|c| c.as_bytes()).collect(),
        });
        tensors.push(i64_tensor(
            tensor::VIDEO_GRID_THW,
            vec![batch.video_grid_thw.len() as u64 / 3, 3],
            &video_grid,
        ));
        if batch.second_per_grid_ts.iter().any(|&s| s > 0.0) {
            tensors.push(TensorRef {
                name: tensor::SECOND_PER_GRID_TS,
                dtype: stoker_wire::DType::F32,
                shape: vec![batch.second_per_grid_ts.len() as u64],
                chunks: vec![&seconds],
            });
        }
    }
    let packing = batch.packing.as_ref().map(|p| {
        let cu: Vec<u8> = p.cu_seqlens.iter().flat_map(|x| x.to_le_bytes()).collect();
        let counts = (i64_bytes(&p.pack_images), i64_bytes(&p.pack_videos));
        (p, i64_bytes(&p.position_ids), cu, counts)
    });
    if let Some((p, positions, cu, (images, videos))) = &packing {
        tensors.push(i64_tensor(tensor::POSITION_IDS, vec![4, b, l], positions));
        tensors.push(TensorRef {
            name: tensor::CU_SEQLENS,
            dtype: stoker_wire::DType::I32,
            shape: vec![b, p.max_samples as u64 + 1],
            chunks: vec![cu],
        });
        tensors.push(i64_tensor(tensor::PACK_IMAGES, vec![b], images));
        if !batch.video_chunks.is_empty() {
            tensors.push(i64_tensor(tensor::PACK_VIDEOS, vec![b], videos));
        }
    }
    let with_videos = !batch.video_chunks.is_empty();
    let luts = [
        (tensor::PIXEL_LUT, pixel_lut, true),
        (tensor::PIXEL_LUT_VIDEOS, video_lut, with_videos),
    ];
    for (name, lut, wanted) in luts {
        if let (Some(lut), true) = (lut, wanted) {
            tensors.push(TensorRef {
                name,
                dtype: stoker_wire::DType::F32,
                shape: vec![3, 256],
                chunks: vec![lut],
            });
        }
    }
    let (head, pads) = BatchHead::layout(
        req,
        batch.sample_ids.clone(),
        batch.skipped.clone(),
        &tensors,
    );
    let total = head.len() as u64
        + tensors
            .iter()
            .zip(&pads)
            .map(|(t, p)| *p as u64 + t.nbytes())
            .sum::<u64>();
    w.write_all(
        &FrameHeader {
            kind: Kind::Batch,
            len: total,
        }
        .encode(),
    )
    .await?;
    w.write_all(&head).await?;
    let zeros = [0u8; stoker_wire::ALIGN];
    for (t, pad) in tensors.iter().zip(pads) {
        w.write_all(&zeros[..pad]).await?;
        for c in &t.chunks {
            w.write_all(c).await?;
        }
    }
    Ok(total + HEADER_LEN as u64)
}

/// Room a batch frame keeps beside the tensors for its head (sample ids, skip reasons) and
/// alignment padding.
const FRAME_HEAD_ROOM: u64 = 64 << 20;

/// A batch too large for one frame fails by name (every worker would build the same one),
/// rather than breaking the connection of the client reading it, again on every worker.
pub fn check_frame_size(batch: &Batch, max_payload: u64) -> Result<(), String> {
    let bytes = batch.tensor_bytes();
    if bytes + FRAME_HEAD_ROOM <= max_payload {
        return Ok(());
    }
    Err(format!(
        "the batch's tensors are {bytes} bytes, more than a batch frame carries ({max_payload} \
         bytes with its head): lower global_batch_size, max_pixels or max_images_per_sample, \
         or use pixel_dtype u8"
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::preprocess::vision::PixelBuf;

    #[test]
    fn a_batch_over_the_frame_limit_is_refused_by_name() {
        let batch = Batch {
            sample_ids: vec![0],
            skipped: vec![],
            rows: 1,
            input_ids: vec![1; 10],
            labels: vec![1; 10],
            attention_mask: vec![1; 10],
            seq_len: 10,
            pixel_chunks: vec![PixelBuf::F32(vec![0.0; 1000])],
            pixel_rows: 1,
            image_grid_thw: vec![1, 1, 1],
            video_chunks: vec![],
            video_rows: 0,
            video_grid_thw: vec![],
            second_per_grid_ts: vec![],
            packing: None,
        };
        assert_eq!(batch.tensor_bytes(), 33 * 8 + 4000);
        assert!(check_frame_size(&batch, FRAME_HEAD_ROOM + 4264).is_ok());
        let e = check_frame_size(&batch, FRAME_HEAD_ROOM + 4263).unwrap_err();
        assert!(e.starts_with("the batch's tensors are 4264 bytes"), "{e}");
    }
}
