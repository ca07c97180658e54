//! A sample's media checked in order from their headers, before a pixel is decoded: what each
//! costs of the sample's budgets, the limits it leaves the next, and the tokens it takes.
//! Measuring a sample (`dataset stats`, the lengths) and serving it run the same checks, so
//! both decide alike, and serving decodes only the media its truncation keeps.

use crate::dataset::sample::VideoPart;
use crate::failure::{image_cause, video_cause, Cause};
use crate::limits::SampleLimits;
use crate::preprocess::preset::Preset;
use crate::preprocess::text::MediaTokens;
use crate::preprocess::video::{self, VideoBudget};
use crate::preprocess::vision::{DecodeLimits, ImageHeader, Spent};

pub(crate) struct MediaCheck<'p> {
    preset: &'p Preset,
    limits: &'p SampleLimits,
    spent: Spent,
}

impl<'p> MediaCheck<'p> {
    pub(crate) fn new(preset: &'p Preset, limits: &'p SampleLimits) -> Self {
        MediaCheck {
            preset,
            limits,
            spent: Spent::default(),
        }
    }

    /// An image, its limits checked and its cost charged: the limits to decode it with, and
    /// its tokens.
    pub(crate) fn image(
        &mut self,
        key: &str,
        header: &ImageHeader,
    ) -> Result<(DecodeLimits, MediaTokens), Cause> {
        let decode = self.charge(key, header)?;
        let refused = |err| image_cause(self.limits, key, err);
        let resized = self.preset.resized(header.upright()).map_err(refused)?;
        Ok((
            decode,
            MediaTokens::Image(self.preset.image_tokens(resized)),
        ))
    }

    /// One frame of a frame list, charged as an image; of the size of the list's first
    /// (`first`, set by the first frame).
    pub(crate) fn frame(
        &mut self,
        key: &str,
        header: &ImageHeader,
        first: &mut Option<(u32, u32)>,
    ) -> Result<DecodeLimits, Cause> {
        let decode = self.charge(key, header)?;
        let first = *first.get_or_insert(header.upright());
        video::same_size(key, header.upright(), first).map_err(|e| video_cause(key, e))?;
        Ok(decode)
    }

    /// A frame list whose `count` frames of `upright` size are checked: its tokens and the
    /// pixels its resized frames may take.
    pub(crate) fn frame_list(
        &self,
        first_key: &str,
        count: usize,
        upright: (u32, u32),
        part: &VideoPart,
    ) -> Result<(MediaTokens, u64), Cause> {
        let left = self.limits.pixels_left(self.spent);
        let (tokens, _) = video::measure_frame_list(count, upright, part, self.preset, left)
            .map_err(|e| video_cause(first_key, e))?;
        Ok((MediaTokens::Video(tokens), left))
    }

    /// The next clip's budget; its cost is charged once known ([`Self::spend`]).
    pub(crate) fn next_clip(&self) -> VideoBudget {
        self.limits.next_video(self.spent)
    }

    pub(crate) fn spend(&mut self, cost: Spent) {
        self.spent += cost;
    }

    fn charge(&mut self, key: &str, header: &ImageHeader) -> Result<DecodeLimits, Cause> {
        let decode = self.limits.next_image(self.spent);
        self.spent += header
            .check(decode)
            .map_err(|err| image_cause(self.limits, key, err))?;
        Ok(decode)
    }
}
