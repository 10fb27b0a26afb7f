from slugger.slug import slugify
