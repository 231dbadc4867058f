//! The `image` converter in `mode = "tensor"`: any image model's input by configuration
//! (`image::tensor`), one call, the outputs through the task's `[[outputs]]` rows (`outputs`).
//! Apart from `image` so that `outputs` may read `image` (face boxes) without a circle.

use std::sync::Arc;


use super::image::{tensor, ImageOptions};
use super::outputs::{Outputs, OutputsFinish};
use super::{Converted, Converter, Plan};
use crate::failure::Failure;

pub struct ImageModelTask {
    options: ImageOptions,
    outputs: Arc<Outputs>,
}

impl ImageModelTask {
    pub fn new(options: ImageOptions, outputs: Arc<Outputs>) -> Self {
        ImageModelTask { options, outputs }
    }
}

impl Converter for ImageModelTask {
    fn plan(&self, options: Option<&serde_json::Value>) -> Result<Arc<dyn Plan>, Failure> {
        super::no_options(options)?;
        Ok(Arc::new(TensorPlan { options: self.options.clone(), outputs: self.outputs.clone() }))
    }
}

/// One call with the configured input, the outputs by the task's rows.
struct TensorPlan {
    options: ImageOptions,
    outputs: Arc<Outputs>,
}

impl Plan for TensorPlan {
    fn probe(&self, bytes: &[u8]) -> Result<u64, Failure> {
        tensor::probe_bytes(bytes, &self.options)
    }

    fn convert(&self, bytes: &[u8]) -> Result<Converted, Failure> {
        let (tensor, input, placement) = tensor::convert(bytes, &self.options)?;
        let finish = OutputsFinish { outputs: self.outputs.clone(), input, placement: Some(placement) };
        Ok(Converted::one(tensor, self.outputs.names(), Box::new(finish)))
    }
}
