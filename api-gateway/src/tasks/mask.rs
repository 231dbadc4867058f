//! `mask_png`: a model's `[h, w]` map (`[1, h, w]`, `[1, 1, h, w]`) as a PNG of the input
//! image's size. The map covers the model input; each image pixel's centre is carried into the
//! model input through the image converter's placement (`model = image · scale + pad`, which
//! undoes the resize, letterbox or crop), then into the map by the map's share of the model
//! input, and takes that map cell (nearest). Image pixels the model input does not cover (cut
//! off by a crop) are background. Without a placement (not an image converter) the PNG is the
//! map's own size.
//!
//! A yes/no map (probabilities thresholded, or BOOL) is an 8-bit greyscale PNG of 0 and 255;
//! class labels are the indices of a palette PNG (at most 256 classes), with PASCAL VOC's
//! colours, so label 0 (background) is black.

use super::image::Placement;

/// A map's cells.
pub enum Map {
    /// Yes (255) or no (0).
    Binary(Vec<bool>),
    /// A class index per cell.
    Labels(Vec<u8>),
}

impl Map {
    fn len(&self) -> usize {
        match self {
            Map::Binary(v) => v.len(),
            Map::Labels(v) => v.len(),
        }
    }

    fn at(&self, i: usize) -> u8 {
        match self {
            Map::Binary(v) => u8::from(v[i]) * 255,
            Map::Labels(v) => v[i],
        }
    }
}

/// The map's height and width from its shape: `[h, w]` with any leading 1s.
pub fn map_size(shape: &[usize]) -> Result<(usize, usize), String> {
    let (lead, hw) = shape.split_at(shape.len().saturating_sub(2));
    if hw.len() != 2 || lead.iter().any(|&d| d != 1) || hw.contains(&0) {
        return Err(format!("mask_png takes a [h, w] map (or [1, h, w], [1, 1, h, w]), got shape {shape:?}"));
    }
    Ok((hw[0], hw[1]))
}

/// The PNG, with its width and height.
pub fn render(map: &Map, shape: &[usize], frame: Option<(&Placement, (u32, u32))>) -> Result<(Vec<u8>, u32, u32), String> {
    let (h, w) = map_size(shape)?;
    if map.len() != h * w {
        return Err(format!("a map of shape {shape:?} with {} values", map.len()));
    }
    let (width, height, pixels) = match frame {
        None => (w as u32, h as u32, (0..h * w).map(|i| map.at(i)).collect::<Vec<u8>>()),
        Some((placement, (model_w, model_h))) => {
            let (iw, ih) = (placement.width, placement.height);
            let (to_u, to_v) = (w as f64 / f64::from(model_w.max(1)), h as f64 / f64::from(model_h.max(1)));
            // Each column's and each row's map cell, once.
            let column = |x: u32| {
                let m = (f64::from(x) + 0.5) * f64::from(placement.scale_x) + f64::from(placement.pad_x);
                let u = (m * to_u).floor();
                (u >= 0.0 && u < w as f64).then_some(u as usize)
            };
            let row = |y: u32| {
                let m = (f64::from(y) + 0.5) * f64::from(placement.scale_y) + f64::from(placement.pad_y);
                let v = (m * to_v).floor();
                (v >= 0.0 && v < h as f64).then_some(v as usize)
            };
            let columns: Vec<Option<usize>> = (0..iw).map(column).collect();
            let mut pixels = Vec::with_capacity(iw as usize * ih as usize);
            for y in 0..ih {
                let v = row(y);
                pixels.extend(columns.iter().map(|u| match (u, v) {
                    (Some(u), Some(v)) => map.at(v * w + u),
                    _ => 0,
                }));
            }
            (iw, ih, pixels)
        }
    };
    let mut png = Vec::new();
    {
        let mut encoder = png::Encoder::new(&mut png, width, height);
        encoder.set_depth(png::BitDepth::Eight);
        match map {
            Map::Binary(_) => encoder.set_color(png::ColorType::Grayscale),
            Map::Labels(_) => {
                encoder.set_color(png::ColorType::Indexed);
                encoder.set_palette(palette());
            }
        }
        let mut writer = encoder.write_header().map_err(|e| format!("writing the PNG: {e}"))?;
        writer.write_image_data(&pixels).map_err(|e| format!("writing the PNG: {e}"))?;
    }
    Ok((png, width, height))
}

/// PASCAL VOC's 256 colours: label `i`'s bits spread over the high bits of R, G and B.
fn palette() -> Vec<u8> {
    let mut colours = Vec::with_capacity(256 * 3);
    for label in 0..256u32 {
        let (mut r, mut g, mut b, mut c) = (0u8, 0u8, 0u8, label);
        for shift in (0..8).rev() {
            r |= ((c & 1) as u8) << shift;
            g |= (((c >> 1) & 1) as u8) << shift;
            b |= (((c >> 2) & 1) as u8) << shift;
            c >>= 3;
        }
        colours.extend([r, g, b]);
    }
    colours
}

#[cfg(test)]
mod tests {
    use super::*;

    fn decode(png: &[u8]) -> (png::OutputInfo, Vec<u8>, Option<Vec<u8>>) {
        let decoder = png::Decoder::new(std::io::Cursor::new(png));
        let mut reader = decoder.read_info().expect("a png");
        let mut buf = vec![0; reader.output_buffer_size().expect("size")];
        let info = reader.next_frame(&mut buf).expect("a frame");
        let palette = reader.info().palette.as_ref().map(|p| p.to_vec());
        buf.truncate(info.buffer_size());
        (info, buf, palette)
    }

    #[test]
    fn a_map_the_size_of_a_stretched_image_comes_back_at_the_image_size() {
        // A 4x2 image stretched to a 2x2 model input; the map is the model input's size.
        let placement = Placement { scale_x: 0.5, scale_y: 1.0, pad_x: 0.0, pad_y: 0.0, width: 4, height: 2 };
        let map = Map::Binary(vec![true, false, false, true]);
        let (png, w, h) = render(&map, &[1, 2, 2], Some((&placement, (2, 2)))).expect("renders");
        assert_eq!((w, h), (4, 2));
        let (info, pixels, _) = decode(&png);
        assert_eq!((info.width, info.height), (4, 2));
        assert_eq!(pixels, vec![255, 255, 0, 0, 0, 0, 255, 255]);
    }

    #[test]
    fn letterbox_padding_is_left_out_and_a_crop_leaves_background() {
        // A 2x1 image letterboxed into a 2x2 model input: it sits in the top... middle row band.
        // model = image * 1 + (0, 0.5): the image's row covers model rows 0.5..1.5, its centre 1.0.
        let placement = Placement { scale_x: 1.0, scale_y: 1.0, pad_x: 0.0, pad_y: 0.5, width: 2, height: 1 };
        let map = Map::Binary(vec![false, false, true, false]);
        let (png, ..) = render(&map, &[2, 2], Some((&placement, (2, 2)))).expect("renders");
        assert_eq!(decode(&png).1, vec![255, 0]);
        // A 4x1 image cropped to its middle two columns: the outer columns are background.
        let crop = Placement { scale_x: 1.0, scale_y: 1.0, pad_x: -1.0, pad_y: 0.0, width: 4, height: 1 };
        let (png, ..) = render(&Map::Binary(vec![true, true]), &[1, 2], Some((&crop, (2, 1)))).expect("renders");
        assert_eq!(decode(&png).1, vec![0, 255, 255, 0]);
    }

    #[test]
    fn labels_are_a_palette_image_and_bad_shapes_are_refused() {
        let (png, w, h) = render(&Map::Labels(vec![0, 1, 2, 15]), &[2, 2], None).expect("renders");
        assert_eq!((w, h), (2, 2));
        let (info, pixels, palette) = decode(&png);
        assert_eq!(info.color_type, png::ColorType::Indexed);
        assert_eq!(pixels, vec![0, 1, 2, 15]);
        let palette = palette.expect("a palette");
        assert_eq!(&palette[..6], &[0, 0, 0, 128, 0, 0], "VOC: background black, class 1 dark red");
        for bad in [vec![2, 2, 2], vec![4], vec![0, 3]] {
            assert!(render(&Map::Binary(vec![false; 8]), &bad, None).is_err(), "{bad:?}");
        }
    }
}
