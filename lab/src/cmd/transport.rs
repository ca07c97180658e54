//! `stoker-lab bench transport-server`: a protocol peer that answers every request with the same
//! prebuilt batch, so that benches/transport.py measures the transport alone (client receive
//! into numpy views vs a plain TCP copy vs pickling through a multiprocessing queue).
//!
//! A connection that starts with `RAW ` + u64 n instead of a Hello gets n payloads as plain
//! bytes, no framing: the TCP copy bound, sent by the same process in the same way. With
//! `--tls-dir` it serves TLS 1.3 only, with a certificate for 127.0.0.1 from a CA made for the
//! run (its `ca.crt` printed for the client to trust).

use std::sync::Arc;
use stoker_tls::issue::{unique_name, Authority};
use stoker_tls::ServerTls;
use stoker_wire::io::{read_frame, write_frame};
use stoker_wire::{
    encode_batch, BatchRequest, DType, FrameHeader, Kind, MediaTokens, TensorRef, Welcome,
    MAX_CONTROL_PAYLOAD,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

#[derive(clap::Args)]
pub struct TransportServerArgs {
    /// Size of the batch, in MiB (mostly float32 pixel_values, like a Qwen-VL batch).
    #[arg(long, default_value_t = 64)]
    batch_mib: u64,
    #[arg(long, default_value = "127.0.0.1:0")]
    listen: String,
    /// Serve TLS: write a fresh CA and a certificate for 127.0.0.1 here, and print the CA's path.
    #[arg(long)]
    tls_dir: Option<std::path::PathBuf>,
}

const PLAN_ID: u64 = 0x7472_616e_7370_6f72;

/// The media tokens of the batch below (Qwen2-VL's pad ids, merged 2x2).
const MEDIA: MediaTokens = MediaTokens {
    image_token: 151655,
    video_token: 151656,
    merge_size: 2,
};

/// One Qwen2-VL-shaped batch of about `mib` MiB (8 samples of 1024 tokens, the rest pixels):
/// an image per sample, of grid 1 x 2 x w, whose t·h·w / 4 pad tokens open its row, so that
/// the client's media check passes as on a real batch.
fn batch_payload(mib: u64) -> Vec<u8> {
    let (b, l, dim) = (8u64, 1024u64, 3 * 2 * 14 * 14u64);
    // Pixel rows per image: a multiple of 4 (whole 2x2 merges of a 2-high grid).
    let per_image = (((mib << 20) / (dim * 4) / b) / 4 * 4).clamp(4, 4 * l);
    let rows = per_image * b;
    let pads = per_image / 4;
    let ids: Vec<u8> = (0..b * l)
        .map(|i| match i % l < pads {
            true => i64::from(MEDIA.image_token),
            false => (i % l) as i64,
        })
        .flat_map(|v| v.to_le_bytes())
        .collect();
    let pixels: Vec<u8> = (0..rows * dim)
        .flat_map(|i| ((i % 251) as f32 / 251.0).to_le_bytes())
        .collect();
    let grid: Vec<u8> = (0..b)
        .flat_map(|_| [1i64, 2, (per_image / 2) as i64])
        .flat_map(|v| v.to_le_bytes())
        .collect();
    let t = |name, dtype, shape: Vec<u64>, bytes| TensorRef {
        name,
        dtype,
        shape,
        chunks: vec![bytes],
    };
    let tensors = [
        t("input_ids", DType::I64, vec![b, l], &ids),
        t("labels", DType::I64, vec![b, l], &ids),
        t("attention_mask", DType::I64, vec![b, l], &ids),
        t("pixel_values", DType::F32, vec![rows, dim], &pixels),
        t("image_grid_thw", DType::I64, vec![b, 3], &grid),
    ];
    let request = BatchRequest {
        request_id: 0,
        plan_id: PLAN_ID,
        epoch: 0,
        global_batch: 0,
        rank: 0,
        world_size: 1,
    };
    encode_batch(request, (0..b).collect(), Vec::new(), &tensors)
}

pub async fn run(a: TransportServerArgs) -> anyhow::Result<()> {
    let payload = Arc::new(batch_payload(a.batch_mib));
    let listener = tokio::net::TcpListener::bind(&a.listen).await?;
    println!("payload {}", payload.len());
    println!("listening {}", listener.local_addr()?);
    let tls = match &a.tls_dir {
        Some(dir) => {
            let ca = Authority::new(&unique_name("stoker transport bench CA"), DAY)?;
            let worker = ca.issue(&["127.0.0.1".into()], DAY)?;
            let (cert, key) = ca.write_files(dir, &worker)?;
            println!("ca {}", dir.join("ca.crt").display());
            Some(ServerTls::from_files(cert, key)?)
        }
        None => None,
    };
    loop {
        let (sock, _) = listener.accept().await?;
        let (payload, tls) = (payload.clone(), tls.clone());
        tokio::spawn(async move {
            if let Err(e) = serve(sock, &payload, tls).await {
                tracing::debug!("transport connection: {e:#}");
            }
        });
    }
}

const DAY: std::time::Duration = std::time::Duration::from_secs(86_400);

async fn serve(
    mut sock: tokio::net::TcpStream,
    payload: &[u8],
    tls: Option<ServerTls>,
) -> anyhow::Result<()> {
    sock.set_nodelay(true)?;
    if let Some(tls) = tls {
        let (rd, wr) = tokio::io::split(tls.accept(sock).await?);
        return answer(rd, wr, payload).await;
    }
    let mut first = [0u8; 4];
    sock.peek(&mut first).await?;
    if &first == b"RAW " {
        let mut hdr = [0u8; 12];
        sock.read_exact(&mut hdr).await?;
        let n = u64::from_le_bytes(hdr[4..].try_into().expect("8 bytes"));
        for _ in 0..n {
            sock.write_all(payload).await?;
        }
        return Ok(());
    }
    let (rd, wr) = sock.into_split();
    answer(rd, wr, payload).await
}

/// The protocol: Hello, Welcome, then the payload for every request.
async fn answer(
    mut rd: impl tokio::io::AsyncRead + Unpin,
    mut wr: impl tokio::io::AsyncWrite + Unpin,
    payload: &[u8],
) -> anyhow::Result<()> {
    anyhow::ensure!(
        matches!(
            read_frame(&mut rd, MAX_CONTROL_PAYLOAD).await?,
            Some((Kind::Hello, _))
        ),
        "expected Hello"
    );
    let welcome = Welcome {
        plan_id: PLAN_ID,
        dataset_version: 1,
        num_samples: 8 << 40,
        global_batch_size: 8,
        batches_per_epoch: 1 << 40,
        description: "transport benchmark".into(),
        // No connection limit here.
        max_connections: u32::MAX,
        links_per_rank: 0,
        media: MEDIA,
    };
    write_frame(&mut wr, Kind::Welcome, &welcome.encode()).await?;
    while let Some((kind, p)) = read_frame(&mut rd, MAX_CONTROL_PAYLOAD).await? {
        anyhow::ensure!(kind == Kind::Request, "expected Request, got {kind:?}");
        let req = BatchRequest::decode(&p)?;
        let header = FrameHeader {
            kind: Kind::Batch,
            len: payload.len() as u64,
        };
        wr.write_all(&header.encode()).await?;
        // The head starts with the echoed request; the rest is the same for every answer.
        wr.write_all(&req.encode()).await?;
        wr.write_all(&payload[BatchRequest::LEN..]).await?;
    }
    Ok(())
}
