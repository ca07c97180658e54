//! Decoded frames → upright packed RGB24, the pixels PyAV's `to_ndarray(format="rgb24")` gives.
//!
//! PyAV converts with the swscale of the FFmpeg it bundles (8.1); the worker links Debian's
//! (5.1). Where the two would give other pixels (swscale's scaler path: an odd height, more than
//! 8 bits), the frame is first resampled as 8.1 resamples its chroma (`sws_chroma`).

use super::sws_chroma::Resampler;
use super::video_error::VideoError;
use super::vision::Rgb;
use ffmpeg_next as ff;

/// What a conversion is made for: the format swscale reads, the size, colour matrix and range.
type ScalerKey = (ff::format::Pixel, u32, u32, i32, i32);

/// YUV (or any pixel format) → packed RGB24 at the frame's own size, as PyAV converts: swscale,
/// bilinear, the frame's colour matrix (BT.601 when it names none) and range, full-range output.
#[derive(Default)]
pub(super) struct Converter {
    scaler: Option<(ff::software::scaling::Context, ScalerKey)>,
    rgb: Option<ff::frame::Video>,
    /// The frame swscale converts instead of the decoded one, where that changes the pixels.
    resampled: Option<Resampler>,
}

impl Converter {
    pub(super) fn rgb(
        &mut self,
        frame: &ff::frame::Video,
        rotation: u16,
    ) -> Result<Rgb, VideoError> {
        let (w, h) = (frame.width(), frame.height());
        // SAFETY: plain fields of a decoded frame.
        let (space, range) = unsafe {
            let p = frame.as_ptr();
            ((*p).colorspace as i32, (*p).color_range as i32)
        };
        let input = Resampler::resample(&mut self.resampled, frame);
        let key = (input.format(), w, h, space, range);
        if self.scaler.as_ref().map(|(_, k)| *k) != Some(key) {
            let mut ctx = ff::software::scaling::Context::get(
                input.format(),
                w,
                h,
                ff::format::Pixel::RGB24,
                w,
                h,
                ff::software::scaling::Flags::BILINEAR,
            )
            .map_err(|e| VideoError::corrupt("converting to RGB", e))?;
            set_colorspace(&mut ctx, space, range);
            self.scaler = Some((ctx, key));
            self.rgb = Some(ff::frame::Video::new(ff::format::Pixel::RGB24, w, h));
        }
        let (scaler, _) = self.scaler.as_mut().expect("set above");
        let out = self.rgb.as_mut().expect("set with the scaler");
        scaler
            .run(input, out)
            .map_err(|e| VideoError::corrupt("converting to RGB", e))?;
        let (w, h) = (w as usize, h as usize);
        let stride = out.stride(0);
        let plane = out.data(0);
        let mut data = Vec::with_capacity(w * h * 3);
        for y in 0..h {
            data.extend_from_slice(&plane[y * stride..y * stride + w * 3]);
        }
        Ok(rotate(
            Rgb {
                width: w,
                height: h,
                data,
            },
            rotation,
        ))
    }
}

/// The colour matrix and input range of a conversion, from the frame's own (as PyAV does).
fn set_colorspace(ctx: &mut ff::software::scaling::Context, space: i32, range: i32) {
    use ff::ffi::*;
    let sws_space = match space {
        x if x == AVColorSpace::AVCOL_SPC_BT709 as i32 => SWS_CS_ITU709,
        x if x == AVColorSpace::AVCOL_SPC_FCC as i32 => SWS_CS_FCC,
        x if x == AVColorSpace::AVCOL_SPC_SMPTE240M as i32 => SWS_CS_SMPTE240M,
        x if x == AVColorSpace::AVCOL_SPC_BT2020_NCL as i32
            || x == AVColorSpace::AVCOL_SPC_BT2020_CL as i32 =>
        {
            SWS_CS_BT2020
        }
        _ => SWS_CS_DEFAULT,
    };
    let full = i32::from(range == AVColorRange::AVCOL_RANGE_JPEG as i32);
    // SAFETY: the context is valid; the coefficient tables are static.
    unsafe {
        let table = sws_getCoefficients(sws_space);
        let dst = sws_getCoefficients(SWS_CS_DEFAULT);
        sws_setColorspaceDetails(ctx.as_mut_ptr(), table, full, dst, 1, 0, 1 << 16, 1 << 16);
    }
}

/// `rgb` turned clockwise by `degrees` (a multiple of 90).
fn rotate(rgb: Rgb, degrees: u16) -> Rgb {
    let (w, h) = (rgb.width, rgb.height);
    let (nw, nh) = match degrees {
        90 | 270 => (h, w),
        180 => (w, h),
        _ => return rgb,
    };
    let mut data = vec![0u8; w * h * 3];
    for y in 0..h {
        for x in 0..w {
            let (nx, ny) = match degrees {
                90 => (h - 1 - y, x),
                180 => (w - 1 - x, h - 1 - y),
                _ => (y, w - 1 - x),
            };
            let (s, d) = ((y * w + x) * 3, (ny * nw + nx) * 3);
            data[d..d + 3].copy_from_slice(&rgb.data[s..s + 3]);
        }
    }
    Rgb {
        width: nw,
        height: nh,
        data,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rotation_turns_clockwise() {
        // 2x1 image: red then green.
        let rgb = Rgb {
            width: 2,
            height: 1,
            data: vec![255, 0, 0, 0, 255, 0],
        };
        let r = rotate(rgb, 90);
        assert_eq!((r.width, r.height), (1, 2));
        // Clockwise: the left pixel ends up on top.
        assert_eq!(r.data, vec![255, 0, 0, 0, 255, 0]);
        let r = rotate(r, 90);
        assert_eq!((r.width, r.height), (2, 1));
        assert_eq!(r.data, vec![0, 255, 0, 255, 0, 0]);
    }
}
