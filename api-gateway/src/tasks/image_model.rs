//! The `image` converter in `mode = "tensor"`: any image model's input by configuration
//! (`image::tensor`), one call, the outputs through the task's `[[outputs]]` rows (`outputs`).
//! Apart from `image` so that `outputs` may read `image` (face boxes) without a circle.

use super::image::{tensor, ImageOptions};
use super::fit::{Dim, Sent, SentTensor};
use super::outputs::{InputConverter, ModelInput};
use crate::failure::Failure;

/// The input side of the image tensor mode (a [`super::outputs::ConfiguredTask`]).
pub struct ImageInput {
    pub options: ImageOptions,
}

impl InputConverter for ImageInput {
    fn probe(&self, bytes: &[u8]) -> Result<u64, Failure> {
        tensor::probe_bytes(bytes, &self.options)
    }

    fn convert(&self, bytes: &[u8]) -> Result<ModelInput, Failure> {
        let (tensor, input, placement) = tensor::convert(bytes, &self.options)?;
        let model_size = (self.options.width, self.options.height);
        Ok(ModelInput { tensors: vec![tensor], input, placement: Some((placement, model_size)) })
    }

    fn sends(&self) -> Sent {
        let shape = tensor::shape(&self.options).into_iter().map(Dim::Fixed).collect();
        Sent::One(SentTensor::new("image.input", &self.options.input, Some(self.options.datatype), Some(shape)))
    }
}
